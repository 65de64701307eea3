// Multi-head latent attention's decode (DeepSeek-V2 / -V3), absorbed form, in one call: each
// decoding sequence b's query heads, straight over the paged latent cache.
//
//   q_lat[b, h]  = q_nope[b, h] W_uk[h]                     (nope -> kv_lora_rank)
//   p[b, h, t]   = softmax_t(scale * ([q_lat, q_pe][b, h] . c[slots[b, t]]))   t < lens[b]
//   o_lat[b, h]  = sum_t p[b, h, t] c[slots[b, t], :rank]   (the latent is K and V at once)
//   out[b, h]    = W_uv[h] o_lat[b, h]                      (kv_lora_rank -> v_head_dim)
//
// Why: torch's path (engine/model/mla.py) runs two bmm's, a gather of every context into a
// padded copy, SDPA and ~10 small ops a layer. At batch 1 the bmm's read W_uk and W_uv (2 x
// 1 MB at the bench's 16 heads, 2 x 16 MB at DeepSeek-V3's 128) at a third of the machine's
// bandwidth. Here each weight row is read once per step, with software prefetch ahead, for
// every sequence of the batch; each latent row is read in place, once per group of heads.
//
// Three passes, each one parallel_for on ATen's pool:
//   1. q_lat by head (W_uk read once), into a float32 scratch with q_pe, both pre-scaled;
//   2. attention by (sequence, group of heads): the heads are split into as many groups as
//      keep every thread busy at small batches; float32 softmax, two passes over the scores;
//   3. out by head (W_uv read once).
// An int8 cache (kv_cache_dtype="int8") dequantizes by its per-(block) scale: on the score,
// and on the probability (the latent is one part of one head: engine/model/kv_quant.py).
// Every sequence is computed alone, in an order that does not depend on the batch. The bf16
// paths (AVX512-BF16 pairs, AMX tiles) live in kernels/mla_bf16.h.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "cache_rows.h"
#include "mla_bf16.h"
#include "panel.h"
#include "panel_amx.h"

namespace {

// Shape, the block sizes, the bf16 paths, and the vector helpers both files use
// (kernels/mla_bf16.h)
using namespace evenflow_mla;

// bytes ahead of a weight row's reads to prefetch: 16 rows of 512 bf16 (the passes stream W_uk
// and W_uv; one core alone keeps too few misses in flight for its share of the bandwidth).
// DeepSeek-V3-shaped batch-1 step against torch's path, A/B in one process: 4 KB ahead 1.23x,
// 8 KB 1.16x, 16 KB 1.25-1.32x, 32 KB 1.24-1.26x (a noisy host: two runs of some)
constexpr int64_t kAheadBytes = 16384;

template <typename T>
inline void prefetch_row(const T* row, int64_t elements) {
  const char* ahead = reinterpret_cast<const char*>(row) + kAheadBytes;
  for (int64_t at = 0; at < elements * static_cast<int64_t>(sizeof(T)); at += 64)
    _mm_prefetch(ahead + at, _MM_HINT_T0);
}

// Up to this many sequences, passes 1 and 3 are bound by reading W_uk / W_uv: each weight row
// is read once, in order, with prefetch. Past it they are bound by their multiply-adds: blocks
// of 4 sequences x 4 vectors in registers, the head's weights (L2-resident) read once a block.
constexpr int64_t kStreamRows = 2;
constexpr int kRowBlock = 4;
// the smallest batch whose passes 1 and 3 take AMX tiles (bf16)
constexpr int64_t kAmxMinBatch = 4;

// pass 1: q_full[b, h] = scale * [q_nope[b, h] W_uk[h], q_pe[b, h]], float32
template <typename T>
void absorb_head_blocked(const T* q_nope, const T* w_uk, const Shape& s, float scale, int64_t h,
                         float* q_full) {
  const int64_t W = s.latent();
  for (int64_t b0 = 0; b0 < s.batch; b0 += kRowBlock) {
    const int rows = static_cast<int>(std::min<int64_t>(kRowBlock, s.batch - b0));
    const T* qn[kRowBlock];
    for (int i = 0; i < kRowBlock; ++i)  // (rows past the batch repeat its last: not stored)
      qn[i] = q_nope + (b0 + std::min(i, rows - 1)) * s.q_nope_stride[0] + h * s.q_nope_stride[1];
    for (int64_t c0 = 0; c0 < s.rank; c0 += kRowBlock * kLanes) {
      const int vecs = static_cast<int>(std::min<int64_t>(kRowBlock, (s.rank - c0) / kLanes));
      f16v acc[kRowBlock][kRowBlock] = {};  // (sequence, vector)
      for (int64_t d = 0; d < s.nope; ++d) {
        const T* w = w_uk + (h * s.nope + d) * s.rank + c0;
        f16v wv[kRowBlock];
        for (int j = 0; j < kRowBlock; ++j) wv[j] = j < vecs ? load16(w + j * kLanes) : f16v{};
        for (int i = 0; i < kRowBlock; ++i) {
          const f16v c = splat(static_cast<float>(qn[i][d]));
          for (int j = 0; j < kRowBlock; ++j) acc[i][j] += c * wv[j];
        }
      }
      for (int i = 0; i < rows; ++i)
        for (int j = 0; j < vecs; ++j)
          store(q_full + ((b0 + i) * s.heads + h) * W + c0 + j * kLanes, acc[i][j] * scale);
    }
  }
}

// Whether passes 1 and 3 run on AMX tiles (bf16, batch kAmxMinBatch+, whole tiles of dims)
template <typename T>
bool weights_on_tiles(const Shape& s) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return std::is_same_v<T, c10::BFloat16> && s.batch >= kAmxMinBatch &&
         evenflow_panel::amx_usable() && s.nope % 32 == 0 && s.rank % 64 == 0 &&
         s.v_dim % 16 == 0;
#else
  (void)s;
  return false;
#endif
}

template <typename T>
void absorb_queries(const T* q_nope, const T* q_pe, const T* w_uk, const Shape& s, float scale,
                    float* q_full) {
  const int64_t W = s.latent();
  const bool tiles = weights_on_tiles<T>(s);
  at::parallel_for(0, s.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(s.rank);
    std::vector<uint16_t> bits;
    if (tiles) evenflow_panel::configure_tiles();
    for (int64_t h = begin; h < end; ++h) {
      for (int64_t b = 0; b < s.batch; ++b) {
        float* q = q_full + (b * s.heads + h) * W;
        const T* pe = q_pe + b * s.q_pe_stride[0] + h * s.q_pe_stride[1];
        for (int64_t d = 0; d < s.rope; ++d) q[s.rank + d] = static_cast<float>(pe[d]) * scale;
      }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (tiles) {
          absorb_head_amx(q_nope, w_uk, s, scale, h, bits, q_full);
          continue;
        }
      }
#endif
      if (s.batch > kStreamRows) {
        absorb_head_blocked(q_nope, w_uk, s, scale, h, q_full);
        continue;
      }
      for (int64_t b = 0; b < s.batch; ++b)
        std::fill(q_full + (b * s.heads + h) * W, q_full + (b * s.heads + h) * W + s.rank, 0.f);
      for (int64_t d = 0; d < s.nope; ++d) {  // W_uk's row d, read once for every sequence
        const T* w = w_uk + (h * s.nope + d) * s.rank;
        prefetch_row(w, s.rank);
        to_float(w, row.data(), s.rank);
        for (int64_t b = 0; b < s.batch; ++b) {
          const T* qn = q_nope + b * s.q_nope_stride[0] + h * s.q_nope_stride[1];
          const f16v c = splat(static_cast<float>(qn[d]) * scale);
          float* q = q_full + (b * s.heads + h) * W;
          for (int64_t v = 0; v < s.rank; v += kLanes)
            store(q + v, load(q + v) + c * load(row.data() + v));
        }
      }
    }
    if (tiles) evenflow_panel::release_tiles();
  });
}

// pass 2, one task: sequence b's heads [first, first + count) over its context -> o_lat.
// The heads go in blocks of kBlock, padded with zero queries (their scores are dropped).
template <typename C>
void attend_latents(const float* q_full, const C* cache, const CacheScales& scales,
                    const int64_t* ctx, int64_t len, int64_t first, int64_t count,
                    const Shape& s, int64_t b, std::vector<float>& scratch, float* o_lat) {
  const int64_t W = s.latent(), padded = std::max<int64_t>((len + kLanes - 1) / kLanes, 1) * kLanes;
  const int64_t heads = (count + kBlock - 1) / kBlock * kBlock;
  scratch.assign(heads * (padded + W), 0.f);
  float* scores = scratch.data();      // (heads, padded)
  float* q = scores + heads * padded;  // (heads, W): this group's queries, zero-padded
  std::memcpy(q, q_full + (b * s.heads + first) * W, count * W * sizeof(float));
  alignas(64) float token_scale[kLanes];
  const f16v lane = f16v{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  f16v top[kMaxGroup];
  for (int64_t i = 0; i < heads; ++i) top[i] = splat(-1e30f);
  for (int64_t t0 = 0; t0 < len; t0 += kLanes) {  // scores, 16 tokens at a time
    const int n = static_cast<int>(std::min<int64_t>(kLanes, len - t0));
    const C* rows[kLanes];
    for (int t = 0; t < kLanes; ++t) {  // padding lanes read the first token again
      rows[t] = cache + ctx[t0 + (t < n ? t : 0)] * W;
      token_scale[t] = row_scale<C>(scales.k, scales, ctx[t0 + (t < n ? t : 0)]);
    }
    f16v part[kMaxGroup][kLanes];  // (head, token): 16-lane partial dot products
    for (int64_t i0 = 0; i0 < heads; i0 += kBlock) {
      for (int t = 0; t < kLanes; t += kBlock) {
        f16v a[kBlock][kBlock] = {};  // (head, token)
        for (int64_t v = 0; v < W; v += kLanes) {
          f16v r[kBlock];
          for (int j = 0; j < kBlock; ++j) r[j] = load_cache(rows[t + j] + v, 1.f);
          for (int h = 0; h < kBlock; ++h) {
            const f16v qv = load(q + (i0 + h) * W + v);
            for (int j = 0; j < kBlock; ++j) a[h][j] += qv * r[j];
          }
        }
        for (int h = 0; h < kBlock; ++h)
          for (int j = 0; j < kBlock; ++j) part[i0 + h][t + j] = a[h][j];
      }
    }
    const f16v token_scales = load(token_scale);
    const f16v real = lane < static_cast<float>(n) ? splat(1.f) : splat(0.f);
    for (int64_t i = 0; i < heads; ++i) {
      // an int8 row's scale multiplies its score once, not each of its values
      f16v sc = row_sums(part[i]) * token_scales;
      sc = real > 0.f ? sc : splat(-1e30f);  // padding: e^(-1e30 - max) = 0
      store(scores + i * padded + t0, sc);
      top[i] = top[i] > sc ? top[i] : sc;
    }
  }
  float inv[kMaxGroup];
  for (int64_t i = 0; i < heads; ++i) {  // probabilities (times the row's scale), their sum
    float* si = scores + i * padded;
    const float total = exponentiate(si, padded, hsum_max(top[i]));
    inv[i] = total > 0.f && i < count ? 1.f / total : 0.f;
    if constexpr (std::is_same_v<C, int8_t>)
      for (int64_t t = 0; t < len; ++t) si[t] *= scales.of(scales.v, ctx[t]);
  }
  for (int64_t i0 = 0; i0 < heads; i0 += kBlock) {  // the latents again, as values
    for (int64_t c0 = 0; c0 < s.rank; c0 += kBlock * kLanes) {
      const int vecs = static_cast<int>(std::min<int64_t>(kBlock, (s.rank - c0) / kLanes));
      f16v a[kBlock][kBlock] = {};  // (head, vector)
      for (int64_t t = 0; t < len; ++t) {
        const C* row = cache + ctx[t] * W + c0;
        f16v r[kBlock];
        for (int j = 0; j < kBlock; ++j) r[j] = j < vecs ? load_cache(row + j * kLanes, 1.f) : f16v{};
        for (int h = 0; h < kBlock; ++h) {
          const f16v p = splat(scores[(i0 + h) * padded + t]);
          for (int j = 0; j < kBlock; ++j) a[h][j] += p * r[j];
        }
      }
      for (int h = 0; h < kBlock && i0 + h < count; ++h) {
        float* o = o_lat + (b * s.heads + first + i0 + h) * s.rank + c0;
        for (int j = 0; j < vecs; ++j) store(o + j * kLanes, a[h][j] * inv[i0 + h]);
      }
    }
  }
}

template <typename C>
void attend(const float* q_full, const C* cache, const CacheScales& scales,
            const int64_t* slots, const int64_t* lens, const Shape& s, float* o_lat) {
  // enough (sequence, head group) tasks for every thread at small batches: a group's heads
  // share each latent row read
  const int64_t threads = at::get_num_threads();
  int64_t groups = std::min<int64_t>(s.heads, (2 * threads + s.batch - 1) / s.batch);
  groups = std::max<int64_t>(groups, (s.heads + kMaxGroup - 1) / kMaxGroup);
  // AMX tiles take 16 heads a task, and pay from 8 (a tile's rows past them are idle)
  const bool tiles = std::is_same_v<C, c10::BFloat16> && evenflow_panel::amx_usable() &&
                     s.latent() % 32 == 0 && s.rank % 64 == 0 &&
                     (s.heads + groups - 1) / groups >= kAmxMinHeads;
  if (tiles) groups = std::max<int64_t>(groups, (s.heads + 15) / 16);
  const int64_t per = (s.heads + groups - 1) / groups;
  at::parallel_for(0, s.batch * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    std::vector<uint16_t> bits;
    bool configured = false;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / groups, first = task % groups * per;
      const int64_t count = std::min(per, s.heads - first);
      if (count <= 0) continue;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if constexpr (std::is_same_v<C, c10::BFloat16>) {
        if (tiles && count >= kAmxMinHeads && lens[b] > 0) {
          if (!configured) evenflow_panel::configure_tiles();
          configured = true;
          attend_latents_amx(q_full, cache, slots + b * s.width, lens[b], first, count, s, b,
                             scratch, bits, o_lat);
          continue;
        }
      }
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__)
      if constexpr (std::is_same_v<C, c10::BFloat16>) {
        if (s.latent() % (2 * kLanes) == 0 && lens[b] > 0) {
          attend_latents_bf16(q_full, cache, slots + b * s.width, lens[b], first, count, s, b,
                              scratch, bits, o_lat);
          continue;
        }
      }
#endif
      attend_latents<C>(q_full, cache, scales, slots + b * s.width, lens[b], first, count, s, b,
                        scratch, o_lat);
    }
    if (configured) evenflow_panel::release_tiles();
  });
}

// pass 3, many sequences: blocks of 4 rows of W_uv x 4 sequences, their 16 dot products
// reduced together (row_sums)
template <typename T>
void expand_head_blocked(const float* o_lat, const T* w_uv, const Shape& s, int64_t h, T* out) {
  for (int64_t j0 = 0; j0 < s.v_dim; j0 += kRowBlock) {
    const int js = static_cast<int>(std::min<int64_t>(kRowBlock, s.v_dim - j0));
    const T* w[kRowBlock];
    for (int j = 0; j < kRowBlock; ++j) w[j] = w_uv + (h * s.v_dim + j0 + std::min(j, js - 1)) * s.rank;
    for (int64_t b0 = 0; b0 < s.batch; b0 += kRowBlock) {
      const int rows = static_cast<int>(std::min<int64_t>(kRowBlock, s.batch - b0));
      const float* o[kRowBlock];
      for (int i = 0; i < kRowBlock; ++i)
        o[i] = o_lat + ((b0 + std::min(i, rows - 1)) * s.heads + h) * s.rank;
      f16v acc[kRowBlock * kRowBlock] = {};  // (row of W_uv, sequence)
      for (int64_t v = 0; v < s.rank; v += kLanes) {
        f16v wv[kRowBlock], ov[kRowBlock];
        for (int j = 0; j < kRowBlock; ++j) wv[j] = load16(w[j] + v);
        for (int i = 0; i < kRowBlock; ++i) ov[i] = load(o[i] + v);
        for (int j = 0; j < kRowBlock; ++j)
          for (int i = 0; i < kRowBlock; ++i) acc[j * kRowBlock + i] += wv[j] * ov[i];
      }
      alignas(64) float sums[kLanes];
      store(sums, row_sums(acc));
      for (int j = 0; j < js; ++j)
        for (int i = 0; i < rows; ++i)
          out[((b0 + i) * s.heads + h) * s.v_dim + j0 + j] = static_cast<T>(sums[j * kRowBlock + i]);
    }
  }
}

// pass 3: out[b, h] = W_uv[h] o_lat[b, h]
template <typename T>
void expand_values(const float* o_lat, const T* w_uv, const Shape& s, T* out) {
  const bool tiles = weights_on_tiles<T>(s);
  at::parallel_for(0, s.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(s.rank);
    std::vector<uint16_t> bits;
    if (tiles) evenflow_panel::configure_tiles();
    for (int64_t h = begin; h < end; ++h) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (tiles) {
          expand_head_amx(o_lat, w_uv, s, h, bits, out);
          continue;
        }
      }
#endif
      if (s.batch > kStreamRows) {
        expand_head_blocked(o_lat, w_uv, s, h, out);
        continue;
      }
      for (int64_t j = 0; j < s.v_dim; ++j) {  // W_uv's row j, read once for every sequence
        const T* w = w_uv + (h * s.v_dim + j) * s.rank;
        prefetch_row(w, s.rank);
        to_float(w, row.data(), s.rank);
        for (int64_t b = 0; b < s.batch; ++b) {
          const float* o = o_lat + (b * s.heads + h) * s.rank;
          f16v s0 = {}, s1 = {};
          int64_t v = 0;
          for (; v + 2 * kLanes <= s.rank; v += 2 * kLanes) {
            s0 += load(o + v) * load(row.data() + v);
            s1 += load(o + v + kLanes) * load(row.data() + v + kLanes);
          }
          if (v < s.rank) s0 += load(o + v) * load(row.data() + v);
          out[(b * s.heads + h) * s.v_dim + j] = static_cast<T>(hsum(s0 + s1));
        }
      }
    }
    if (tiles) evenflow_panel::release_tiles();
  });
}

template <typename T, typename C>
at::Tensor run(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& w_uk,
               const at::Tensor& w_uv, const at::Tensor& cache, const CacheScales& scales,
               const at::Tensor& slots, const at::Tensor& lens, const Shape& s, double scale) {
  auto q_full = at::empty({s.batch, s.heads, s.latent()}, q_nope.options().dtype(at::kFloat));
  auto o_lat = at::empty({s.batch, s.heads, s.rank}, q_full.options());
  auto out = at::empty({s.batch, s.heads, s.v_dim}, q_nope.options());
  const float sc = static_cast<float>(scale);
  absorb_queries<T>(q_nope.data_ptr<T>(), q_pe.data_ptr<T>(), w_uk.data_ptr<T>(), s, sc,
                    q_full.data_ptr<float>());
  attend<C>(q_full.data_ptr<float>(), static_cast<const C*>(cache.data_ptr()), scales,
            slots.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), s, o_lat.data_ptr<float>());
  expand_values<T>(o_lat.data_ptr<float>(), w_uv.data_ptr<T>(), s, out.data_ptr<T>());
  return out;
}

Shape check_args(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& w_uk,
                 const at::Tensor& w_uv, const at::Tensor& cache, const at::Tensor& slots,
                 const at::Tensor& lens) {
  TORCH_CHECK(q_nope.dim() == 3 && q_pe.dim() == 3 && q_nope.stride(2) == 1 &&
                  q_pe.stride(2) == 1 && q_pe.size(0) == q_nope.size(0) &&
                  q_pe.size(1) == q_nope.size(1),
              "q_nope and q_pe must be (B, heads, d) tensors, each row contiguous");
  TORCH_CHECK(q_nope.scalar_type() == q_pe.scalar_type() &&
                  w_uk.scalar_type() == q_nope.scalar_type() &&
                  w_uv.scalar_type() == q_nope.scalar_type(),
              "the queries and the weights must share a dtype");
  const int64_t heads = q_nope.size(1), nope = q_nope.size(2), rope = q_pe.size(2);
  TORCH_CHECK(w_uk.dim() == 3 && w_uk.is_contiguous() && w_uk.size(0) == heads &&
                  w_uk.size(1) == nope,
              "w_uk must be a contiguous (heads, nope, rank) tensor");
  const int64_t rank = w_uk.size(2);
  TORCH_CHECK(w_uv.dim() == 3 && w_uv.is_contiguous() && w_uv.size(0) == heads &&
                  w_uv.size(2) == rank,
              "w_uv must be a contiguous (heads, v_dim, rank) tensor");
  TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous() && cache.size(1) == 1 &&
                  cache.size(2) == rank + rope,
              "the cache must be a contiguous (slots, 1, rank + rope) tensor");
  TORCH_CHECK(rank % kLanes == 0 && (rank + rope) % kLanes == 0,
              "kv_lora_rank and rank + rope must be multiples of 16");
  TORCH_CHECK(heads <= 1024, "at most 1024 heads");
  TORCH_CHECK(slots.dim() == 2 && slots.is_contiguous() && slots.scalar_type() == at::kLong &&
                  slots.size(0) == q_nope.size(0),
              "slots must be a contiguous (B, L) int64 tensor");
  TORCH_CHECK(lens.dim() == 1 && lens.is_contiguous() && lens.scalar_type() == at::kLong &&
                  lens.size(0) == q_nope.size(0),
              "lens must be a contiguous (B,) int64 tensor");
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < q_nope.size(0); ++b) {
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= slots.size(1), "lens must lie in [0, L]");
    for (int64_t t = 0; t < lp[b]; ++t)
      TORCH_CHECK(sp[b * slots.size(1) + t] >= 0 && sp[b * slots.size(1) + t] < cache.size(0),
                  "a slot lies outside the cache");
  }
  return Shape{q_nope.size(0), heads, nope, rope, rank, w_uv.size(1), slots.size(1),
               {q_nope.stride(0), q_nope.stride(1)}, {q_pe.stride(0), q_pe.stride(1)}};
}

template <typename C>
at::Tensor dispatch(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& w_uk,
                    const at::Tensor& w_uv, const at::Tensor& cache, const CacheScales& scales,
                    const at::Tensor& slots, const at::Tensor& lens, const Shape& s,
                    double scale) {
  if (q_nope.scalar_type() == at::kFloat)
    return run<float, C>(q_nope, q_pe, w_uk, w_uv, cache, scales, slots, lens, s, scale);
  TORCH_CHECK(q_nope.scalar_type() == at::kBFloat16, "mla_decode takes float32 or bfloat16");
  return run<c10::BFloat16, C>(q_nope, q_pe, w_uk, w_uv, cache, scales, slots, lens, s, scale);
}

}  // namespace

namespace evenflow_ops {

// q_nope (B, heads, nope), q_pe (B, heads, rope: rotated); w_uk (heads, nope, rank), w_uv
// (heads, v_dim, rank); cache (slots, 1, rank + rope) of the queries' dtype; slots (B, L) and
// lens (B,) int64 -> (B, heads, v_dim)
at::Tensor mla_decode(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& w_uk,
                      const at::Tensor& w_uv, const at::Tensor& cache, const at::Tensor& slots,
                      const at::Tensor& lens, double scale) {
  const Shape s = check_args(q_nope, q_pe, w_uk, w_uv, cache, slots, lens);
  TORCH_CHECK(cache.scalar_type() == q_nope.scalar_type(), "the cache must be of q's dtype");
  if (cache.scalar_type() == at::kFloat)
    return dispatch<float>(q_nope, q_pe, w_uk, w_uv, cache, CacheScales{}, slots, lens, s, scale);
  return dispatch<c10::BFloat16>(q_nope, q_pe, w_uk, w_uv, cache, CacheScales{}, slots, lens, s,
                                 scale);
}

// The same over an int8 cache: scales (blocks + 1, 1) float32, slot s dequantizing by
// scales[s / block_size]
at::Tensor mla_decode_int8(const at::Tensor& q_nope, const at::Tensor& q_pe,
                           const at::Tensor& w_uk, const at::Tensor& w_uv,
                           const at::Tensor& cache, const at::Tensor& scales,
                           const at::Tensor& slots, const at::Tensor& lens, double scale,
                           int64_t block_size) {
  const Shape s = check_args(q_nope, q_pe, w_uk, w_uv, cache, slots, lens);
  TORCH_CHECK(cache.scalar_type() == at::kChar, "the cache must be int8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.is_contiguous() &&
                  scales.size(1) == 1,
              "the scales must be a contiguous (blocks + 1, 1) float32 tensor");
  TORCH_CHECK(block_size >= 1 && cache.size(0) <= scales.size(0) * block_size,
              "the scales must cover every block of the cache");
  const bool power_of_two = (block_size & (block_size - 1)) == 0;
  const CacheScales cs{scales.data_ptr<float>(), scales.data_ptr<float>(), block_size, 1,
                       power_of_two ? __builtin_ctzll(static_cast<uint64_t>(block_size)) : -1};
  return dispatch<int8_t>(q_nope, q_pe, w_uk, w_uv, cache, cs, slots, lens, s, scale);
}

}  // namespace evenflow_ops

TORCH_LIBRARY_FRAGMENT(evenflow_kernels, m) {
  m.def("mla_decode(Tensor q_nope, Tensor q_pe, Tensor w_uk, Tensor w_uv, Tensor cache, "
        "Tensor slots, Tensor lens, float scale) -> Tensor");
  m.def("mla_decode_int8(Tensor q_nope, Tensor q_pe, Tensor w_uk, Tensor w_uv, Tensor cache, "
        "Tensor scales, Tensor slots, Tensor lens, float scale, int block_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(evenflow_kernels, CPU, m) {
  m.impl("mla_decode", &evenflow_ops::mla_decode);
  m.impl("mla_decode_int8", &evenflow_ops::mla_decode_int8);
}
