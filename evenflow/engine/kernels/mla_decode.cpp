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
// Every sequence is computed alone, in an order that does not depend on the batch.

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
#include "panel.h"
#include "panel_amx.h"

namespace {

using evenflow_cache_rows::CacheScales;
using evenflow_cache_rows::hsum;
using evenflow_cache_rows::hsum_max;
using evenflow_cache_rows::load_cache;
using evenflow_cache_rows::row_scale;
using evenflow_cache_rows::row_sums;
using evenflow_cache_rows::to_float;
using evenflow_panel::exp_nonpositive;
using evenflow_panel::f16v;
using evenflow_panel::kLanes;
using evenflow_panel::load;
using evenflow_panel::load16;
using evenflow_panel::splat;
using evenflow_panel::store;

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

struct Shape {
  int64_t batch, heads, nope, rope, rank, v_dim, width;  // width: slots per sequence
  int64_t q_nope_stride[2], q_pe_stride[2];               // (b, h) strides, in elements
  int64_t latent() const { return rank + rope; }          // a cache row
};

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

// Float32 rows as the B operand of a bf16 tile product: dst (width / 2, 16, 2) bf16, row i's
// values 2p and 2p + 1 side by side at [p][i]. Rows past n stay as they were (zeros).
inline void pairs_by_column(const float* rows, int64_t row_stride, int n, int64_t width,
                            uint16_t* dst) {
  alignas(64) uint16_t bf[4096];
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int i = 0; i < n; ++i) {
    for (int64_t c0 = 0; c0 < width; c0 += 4096) {
      const int64_t m = std::min<int64_t>(4096, width - c0);
      for (int64_t c = 0; c < m; c += kLanes)
        evenflow_panel::store16(reinterpret_cast<c10::BFloat16*>(bf + c),
                                load(rows + i * row_stride + c0 + c));
      const uint32_t* words = reinterpret_cast<const uint32_t*>(bf);
      for (int64_t p = 0; p < m / 2; ++p) out[(c0 / 2 + p) * 16 + i] = words[p];
    }
  }
}

#if defined(__AVX512F__)
// Two bf16 rows side by side, value by value: dst[2c] = even[c], dst[2c + 1] = odd[c] (odd
// null: zeros); n a multiple of 16
inline void interleave_rows(const uint16_t* even, const uint16_t* odd, int64_t n, uint16_t* dst) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                              25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                              18, 2, 17, 1, 16, 0);
  for (int64_t d = 0; d < n; d += kLanes) {
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + d));
    const __m256i o = odd != nullptr
        ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + d)) : _mm256_setzero_si256();
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(e), o, 1);
    _mm512_storeu_si512(dst + 2 * d, _mm512_permutexvar_epi16(interleave, both));
  }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Passes 1 and 3 on AMX tiles for bf16 at batch kAmxMinBatch+, 16 sequences a block (their
// multiply-adds, in float32 registers, took ~250 us a layer at batch 8). Tiles configured.
//
// Pass 1: A = the block's q_nope rows (copied, zero past the batch), B = W_uk[h] interleaved
// into (nope / 2, rank, 2) pairs once per head (64 KB at the bench's shape).
void absorb_head_amx(const c10::BFloat16* q_nope, const c10::BFloat16* w_uk, const Shape& s,
                     float scale, int64_t h, std::vector<uint16_t>& bits, float* q_full) {
  const int64_t W = s.latent();
  bits.assign(s.nope * s.rank + 16 * s.nope, 0);
  uint16_t* wv = bits.data();                  // (nope / 2, rank, 2)
  uint16_t* rows = wv + s.nope * s.rank;       // (16, nope)
  const uint16_t* w = reinterpret_cast<const uint16_t*>(w_uk) + h * s.nope * s.rank;
  for (int64_t p = 0; p < s.nope / 2; ++p)
    interleave_rows(w + 2 * p * s.rank, w + (2 * p + 1) * s.rank, s.rank, wv + p * s.rank * 2);
  alignas(64) float out[16 * 64];
  for (int64_t b0 = 0; b0 < s.batch; b0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, s.batch - b0));
    for (int i = 0; i < n; ++i)
      std::memcpy(rows + i * s.nope, q_nope + (b0 + i) * s.q_nope_stride[0] + h * s.q_nope_stride[1],
                  s.nope * 2);
    for (int64_t c0 = 0; c0 < s.rank; c0 += 64) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kp = 0; kp < s.nope / 2; kp += 16) {
        const uint16_t* v = wv + (kp * s.rank + c0) * 2;
        const int64_t stride = s.rank * 4;
        _tile_loadd(4, rows + kp * 2, s.nope * 2);
        _tile_loadd(5, v, stride);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, v + 32, stride);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, v + 64, stride);
        _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, v + 96, stride);
        _tile_dpbf16ps(3, 4, 6);
      }
      _tile_stored(0, out, 256);
      _tile_stored(1, out + 16, 256);
      _tile_stored(2, out + 32, 256);
      _tile_stored(3, out + 48, 256);
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < 4; ++j)
          store(q_full + ((b0 + i) * s.heads + h) * W + c0 + j * kLanes,
                load(out + i * 64 + j * kLanes) * scale);
    }
  }
}

// Pass 3: out[b, h]^T = W_uv[h] (A: its rows in place, 16 at a time) @ o_lat^T (B: the block's
// o_lat rows as bf16 pairs, (rank / 2, 16, 2)).
void expand_head_amx(const float* o_lat, const c10::BFloat16* w_uv, const Shape& s, int64_t h,
                     std::vector<uint16_t>& bits, c10::BFloat16* out) {
  bits.assign(s.rank * 16, 0);
  uint16_t* ov = bits.data();
  const uint16_t* w = reinterpret_cast<const uint16_t*>(w_uv) + h * s.v_dim * s.rank;
  alignas(64) float sums[16 * 16];
  for (int64_t b0 = 0; b0 < s.batch; b0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, s.batch - b0));
    if (n < 16) std::fill(ov, ov + s.rank * 16, 0);
    pairs_by_column(o_lat + (b0 * s.heads + h) * s.rank, s.heads * s.rank, n, s.rank, ov);
    for (int64_t j0 = 0; j0 < s.v_dim; j0 += 16) {
      _tile_zero(0);
      for (int64_t k = 0; k < s.rank; k += 32) {
        _tile_loadd(4, w + j0 * s.rank + k, s.rank * 2);
        _tile_loadd(5, ov + k * 16, 64);
        _tile_dpbf16ps(0, 4, 5);
      }
      _tile_stored(0, sums, 64);
      for (int j = 0; j < 16; ++j)
        for (int i = 0; i < n; ++i)
          out[((b0 + i) * s.heads + h) * s.v_dim + j0 + j] = c10::BFloat16(sums[j * 16 + i]);
    }
  }
}
#endif

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

// A head's scores (`padded` of them, padding at -1e30) -> e^(score - m) in place; their sum
inline float exponentiate(float* scores, int64_t padded, float m) {
  f16v sum = {};
  for (int64_t t = 0; t < padded; t += kLanes) {
    const f16v p = exp_nonpositive(load(scores + t) - m);
    sum += p;
    store(scores + t, p);
  }
  return hsum(sum);
}

// the most heads a pass-2 task takes (its stack arrays)
constexpr int64_t kMaxGroup = 64;

// heads and tokens (scores) or heads and vectors (values) per register block: 16 accumulators,
// each latent and query vector loaded once per block
constexpr int kBlock = 4;
// the fewest heads a task takes AMX tiles for
constexpr int64_t kAmxMinHeads = 8;

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

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// The context's latents (their first `rank` dims) with tokens 2t and 2t + 1 side by side, dim by
// dim: (ceil(len / 2), rank, 2) bf16, a missing last token as zeros. AVX512-BF16's and AMX's
// pairs layout, for the values' multiply-adds.
inline void interleave_pairs(const uint16_t* base, const int64_t* ctx, int64_t len,
                             const Shape& s, uint16_t* pairs) {
  const int64_t W = s.latent();
  for (int64_t t = 0; t < (len + 1) / 2; ++t)
    interleave_rows(base + ctx[2 * t] * W, 2 * t + 1 < len ? base + ctx[2 * t + 1] * W : nullptr,
                    s.rank, pairs + t * s.rank * 2);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// pass 2 over a bf16 cache on AVX512-BF16: the same blocks, but each vdpbf16ps multiplies 32
// pairs where an FMA takes 16 (the compute that batch 8+ is bound by). Queries and
// probabilities are rounded to bf16, as torch's bf16 attention rounds them; sums stay float32.
// The values need pairs of tokens side by side: the context's latents are interleaved once
// per task into `pairs` (L / 2, rank, 2).
void attend_latents_bf16(const float* q_full, const c10::BFloat16* cache, const int64_t* ctx,
                         int64_t len, int64_t first, int64_t count, const Shape& s, int64_t b,
                         std::vector<float>& scratch, std::vector<uint16_t>& bits,
                         float* o_lat) {
  const int64_t W = s.latent(), padded = std::max<int64_t>((len + kLanes - 1) / kLanes, 1) * kLanes;
  const int64_t heads = (count + kBlock - 1) / kBlock * kBlock, half = (len + 1) / 2;
  scratch.assign(heads * padded, 0.f);
  float* scores = scratch.data();  // (heads, padded)
  bits.assign(heads * W + half * 2 * s.rank + heads * half * 2, 0);
  uint16_t* q = bits.data();                      // (heads, W) bf16, zero-padded
  uint16_t* pairs = q + heads * W;                // (half, rank, 2) bf16
  uint16_t* probs = pairs + half * 2 * s.rank;    // (heads, half, 2) bf16
  const float* qf = q_full + (b * s.heads + first) * W;
  for (int64_t i = 0; i < count * W; ++i) q[i] = evenflow_panel::float_to_bf16(qf[i]);
  const uint16_t* base = reinterpret_cast<const uint16_t*>(cache);
  interleave_pairs(base, ctx, len, s, pairs);
  const f16v lane = f16v{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  f16v top[kMaxGroup];
  for (int64_t i = 0; i < heads; ++i) top[i] = splat(-1e30f);
  for (int64_t t0 = 0; t0 < len; t0 += kLanes) {  // scores, 16 tokens at a time
    const int n = static_cast<int>(std::min<int64_t>(kLanes, len - t0));
    const uint16_t* rows[kLanes];
    for (int t = 0; t < kLanes; ++t) rows[t] = base + ctx[t0 + (t < n ? t : 0)] * W;
    f16v part[kMaxGroup][kLanes];
    for (int64_t i0 = 0; i0 < heads; i0 += kBlock) {
      for (int t = 0; t < kLanes; t += kBlock) {
        __m512 a[kBlock][kBlock];
        for (auto& row : a)
          for (auto& x : row) x = _mm512_setzero_ps();
        for (int64_t v = 0; v < W; v += 2 * kLanes) {
          __m512bh r[kBlock];
          for (int j = 0; j < kBlock; ++j)
            r[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(rows[t + j] + v));
          for (int h = 0; h < kBlock; ++h) {
            const __m512bh qv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + (i0 + h) * W + v));
            for (int j = 0; j < kBlock; ++j) a[h][j] = _mm512_dpbf16_ps(a[h][j], qv, r[j]);
          }
        }
        for (int h = 0; h < kBlock; ++h)
          for (int j = 0; j < kBlock; ++j) std::memcpy(&part[i0 + h][t + j], &a[h][j], 64);
      }
    }
    const f16v real = lane < static_cast<float>(n) ? splat(1.f) : splat(0.f);
    for (int64_t i = 0; i < heads; ++i) {
      f16v sc = row_sums(part[i]);
      sc = real > 0.f ? sc : splat(-1e30f);  // padding: e^(-1e30 - max) = 0
      store(scores + i * padded + t0, sc);
      top[i] = top[i] > sc ? top[i] : sc;
    }
  }
  float inv[kMaxGroup];
  for (int64_t i = 0; i < heads; ++i) {  // probabilities, their sum, and their bf16 pairs
    float* si = scores + i * padded;
    const float total = exponentiate(si, padded, hsum_max(top[i]));
    inv[i] = total > 0.f && i < count ? 1.f / total : 0.f;
    uint16_t* pi = probs + i * half * 2;
    for (int64_t t = 0; t < len; ++t) pi[t] = evenflow_panel::float_to_bf16(si[t]);
  }
  for (int64_t i0 = 0; i0 < heads; i0 += kBlock) {  // the interleaved latents, as values
    for (int64_t c0 = 0; c0 < s.rank; c0 += kBlock * kLanes) {
      const int vecs = static_cast<int>(std::min<int64_t>(kBlock, (s.rank - c0) / kLanes));
      __m512 a[kBlock][kBlock];
      for (auto& row : a)
        for (auto& x : row) x = _mm512_setzero_ps();
      for (int64_t t = 0; t < half; ++t) {
        const uint16_t* pr = pairs + (t * s.rank + c0) * 2;
        __m512bh r[kBlock];
        for (int j = 0; j < kBlock; ++j)
          r[j] = reinterpret_cast<__m512bh>(j < vecs ? _mm512_loadu_si512(pr + j * 2 * kLanes)
                                                     : _mm512_setzero_si512());
        for (int h = 0; h < kBlock; ++h) {
          int32_t pair;
          std::memcpy(&pair, probs + ((i0 + h) * half + t) * 2, sizeof pair);
          const __m512bh p = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
          for (int j = 0; j < kBlock; ++j) a[h][j] = _mm512_dpbf16_ps(a[h][j], p, r[j]);
        }
      }
      for (int h = 0; h < kBlock && i0 + h < count; ++h) {
        float* o = o_lat + (b * s.heads + first + i0 + h) * s.rank + c0;
        for (int j = 0; j < vecs; ++j)
          _mm512_storeu_ps(o + j * kLanes, _mm512_mul_ps(a[h][j], _mm512_set1_ps(inv[i0 + h])));
      }
    }
  }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// pass 2 over a bf16 cache on AMX tiles, up to 16 heads a task (the batch sizes where the
// attention's multiply-adds, not the weights, bound the step). Scores: 16 tokens (A: their
// latents, in place when the 16 slots are consecutive, as a block's are) against the queries
// (B: (W / 2, 16 heads, 2) pairs), one 16 x 16 tile. Values: the probabilities (A: 16 heads x
// 32 tokens, bf16) against the interleaved latents (B: `pairs`, 16 token pairs x 16 dims),
// four tiles of 16 dims at a time. Tiles configured by the caller.
void attend_latents_amx(const float* q_full, const c10::BFloat16* cache, const int64_t* ctx,
                        int64_t len, int64_t first, int64_t count, const Shape& s, int64_t b,
                        std::vector<float>& scratch, std::vector<uint16_t>& bits, float* o_lat) {
  constexpr int64_t kTile = 16;
  const int64_t W = s.latent(), padded = (len + 2 * kTile - 1) / (2 * kTile) * 2 * kTile;
  const int64_t half = padded / 2;
  scratch.assign(kTile * padded + kTile * kTile, 0.f);
  float* scores = scratch.data();            // (16, padded), head-major
  float* tile = scores + kTile * padded;     // one 16 x 16 tile, stored
  bits.assign(W * kTile + kTile * W + half * 2 * s.rank + kTile * padded, 0);
  uint16_t* qt = bits.data();                      // (W / 2, 16, 2)
  uint16_t* block = qt + W * kTile;                // (16, W): a token block gathered
  uint16_t* pairs = block + kTile * W;             // (half, rank, 2)
  uint16_t* probs = pairs + half * 2 * s.rank;     // (16, padded) bf16
  const float* qf = q_full + (b * s.heads + first) * W;
  pairs_by_column(qf, W, static_cast<int>(count), W, qt);
  const uint16_t* base = reinterpret_cast<const uint16_t*>(cache);
  interleave_pairs(base, ctx, len, s, pairs);
  for (int64_t t0 = 0; t0 < len; t0 += kTile) {
    const int n = static_cast<int>(std::min<int64_t>(kTile, len - t0));
    bool in_place = n == kTile;
    for (int t = 1; t < n && in_place; ++t) in_place = ctx[t0 + t] == ctx[t0] + t;
    if (!in_place)  // (rows past n keep what they held: their scores are dropped)
      for (int t = 0; t < n; ++t) std::memcpy(block + t * W, base + ctx[t0 + t] * W, W * 2);
    const uint16_t* a = in_place ? base + ctx[t0] * W : block;
    _tile_zero(0);
    for (int64_t k = 0; k < W; k += 2 * kTile) {
      _tile_loadd(4, a + k, W * 2);
      _tile_loadd(5, qt + k * kTile, 4 * kTile);
      _tile_dpbf16ps(0, 4, 5);
    }
    _tile_stored(0, tile, 4 * kTile);
    for (int t = 0; t < n; ++t)
      for (int64_t h = 0; h < count; ++h) scores[h * padded + t0 + t] = tile[t * kTile + h];
  }
  float inv[kTile] = {};
  for (int64_t h = 0; h < count; ++h) {  // probabilities, their sum, as bf16
    float* sh = scores + h * padded;
    float m = -1e30f;
    for (int64_t t = 0; t < len; ++t) m = std::max(m, sh[t]);
    for (int64_t t = len; t < padded; ++t) sh[t] = -1e30f;  // padding: e^(-1e30 - max) = 0
    const float total = exponentiate(sh, padded, m);
    inv[h] = total > 0.f ? 1.f / total : 0.f;
    for (int64_t t = 0; t < padded; ++t) probs[h * padded + t] = evenflow_panel::float_to_bf16(sh[t]);
  }
  for (int64_t d0 = 0; d0 < s.rank; d0 += 4 * kTile) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t p0 = 0; p0 < half; p0 += kTile) {
      const uint16_t* v = pairs + (p0 * s.rank + d0) * 2;
      const int64_t stride = s.rank * 4;
      _tile_loadd(4, probs + p0 * 2, padded * 2);
      _tile_loadd(5, v, stride);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, v + 2 * kTile, stride);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, v + 4 * kTile, stride);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, v + 6 * kTile, stride);
      _tile_dpbf16ps(3, 4, 6);
    }
    alignas(64) float out[kTile * 4 * kTile];  // (16 heads, 64 dims)
    _tile_stored(0, out, 4 * 4 * kTile);
    _tile_stored(1, out + kTile, 4 * 4 * kTile);
    _tile_stored(2, out + 2 * kTile, 4 * 4 * kTile);
    _tile_stored(3, out + 3 * kTile, 4 * 4 * kTile);
    for (int64_t h = 0; h < count; ++h) {
      float* o = o_lat + (b * s.heads + first + h) * s.rank + d0;
      for (int j = 0; j < 4; ++j)
        store(o + j * kLanes, load(out + h * 4 * kTile + j * kLanes) * inv[h]);
    }
  }
}
#endif

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
