// Causal prefill attention (flash-style: online softmax, scores never leave L1) on the panel
// kernels: a sequence's new queries over its whole context — cached prefix and this chunk —
// with K and V read from the paged cache through the context's slots.
//
// Why: torch's CPU flash kernel (scaled_dot_product_attention) ran the 110M model's 2,048-token
// causal attention at ~48 G multiply-adds/s on two cores — 59% of the prefill step — while the
// same cores' bf16 dot product reaches ~230 G/s in a GEMM. With a cached prefix torch's path
// also gathers K and V (index_select) and builds a boolean mask.
//
// How: each KV head's context is packed once into blocks of 64 keys laid out as panels
// (kernels/panel.h): K's block as a (head_dim x 64 keys) panel, so q . k for 64 keys is one
// register-blocked panel pass; V's block as head_dim / 64 panels of 64 keys in, 64 channels out,
// so P @ V is one more. A task is a KV head's group of query heads at a few consecutive query
// positions (rows = positions x heads in the group: they share every K and V block); it walks
// the blocks up to its last position's diagonal with a running max, sum and output per row.
// The arithmetic is torch's flash kernel's: scores in float32 times the scale, e^(s - max) in
// float32 (summed unrounded), P rounded to the input dtype for P @ V, float32 output divided
// by the sum and rounded once. Tasks are taken largest-first from a shared counter (the causal
// triangle makes late positions the expensive ones).
//
// Sliding windows and sinks (GPT-OSS): with a window W a query at position P sees keys
// [P - W + 1, P] (a tile walks only the blocks its rows' windows touch); a head's sink logit
// joins its rows' running max and sum at the end, with no value.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "panel.h"
#include "panel_amx.h"

namespace {

using evenflow_panel::exp_nonpositive;
using evenflow_panel::f16v;
using evenflow_panel::kHasBf16Dot;
using evenflow_panel::kLanes;
using evenflow_panel::kPanel;
using evenflow_panel::kRows;
using evenflow_panel::load;
using evenflow_panel::panel;
using evenflow_panel::splat;
using evenflow_panel::store;

constexpr int kKeys = kPanel;  // keys per block: one panel's outputs (K) or inputs (V)
constexpr int kTileRows = 24;  // rows a task aims for (4 register blocks of kRows = 6)
constexpr int kMaxRows = 64;   // a KV head's group of queries at one position, at most
// AMX tiles (bf16): a task takes 32 rows (two full tiles) and walks the keys 4 blocks (256
// keys) at a time: one softmax pass, one rescale of the output and one tile store per 256 keys
// instead of per 64 (the tile dot products' latency, not their work, set the pace per block).
constexpr int kTileRowsAmx = 32;
constexpr int kChunkBlocks = 4;
constexpr int kChunk = kChunkBlocks * 64;

inline void from_f(float v, float* dst) { *dst = v; }
inline void from_f(float v, uint16_t* dst) { *dst = evenflow_panel::float_to_bf16(v); }
// 16 probabilities stored in the dtype P @ V reads (bf16: round to nearest even, as c10 does)
inline void store_p(float* dst, f16v v) { store(dst, v); }
inline void store_p(uint16_t* dst, f16v v) {
  evenflow_panel::store16(reinterpret_cast<c10::BFloat16*>(dst), v);
}
const f16v kLaneIndex = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

// The shapes and pointers one call works on (T: float, or uint16_t for bf16 bits).
template <typename T>
struct Problem {
  const T* q;            // (q_len, heads, hd) with row stride q_row
  int64_t q_row, q_head;
  const T* k_cache;      // (slots, kv_heads, hd)
  const T* v_cache;
  int64_t slot_row;
  const int64_t* slots;  // (ctx,) the context's cache slots, in token order
  int64_t ctx, q_len, offset;  // offset: context before the first query (ctx - q_len)
  int64_t heads, kv_heads, group, hd, blocks;
  int64_t window;       // 0: causal only
  const float* sinks;   // (heads,) or nullptr
  float scale;
  T* kpack;  // (kv_heads, blocks, hd x 64) panels of K
  T* vpack;  // (kv_heads, blocks, hd / 64 panels of 64 x 64) of V
  T* out;    // (q_len, heads, hd)

  static constexpr int kPair = std::is_same_v<T, float> ? 1 : 2;  // inputs side by side
  int64_t block_elems() const { return kKeys * hd; }
  const T* k_block(int64_t g, int64_t b) const { return kpack + (g * blocks + b) * block_elems(); }
  const T* v_block(int64_t g, int64_t b) const { return vpack + (g * blocks + b) * block_elems(); }
};

// Block b of KV head g into panel layout: K as (hd inputs -> 64 keys), V as hd/64 panels of
// (64 keys -> 64 channels); keys past the context are zeros (masked out anyway).
template <typename T>
void pack_block(const Problem<T>& p, int64_t g, int64_t b) {
  constexpr int kPair = Problem<T>::kPair;
  T* kp = p.kpack + (g * p.blocks + b) * p.block_elems();
  T* vp = p.vpack + (g * p.blocks + b) * p.block_elems();
  const int64_t hd = p.hd;
  for (int j = 0; j < kKeys; ++j) {
    const int64_t key = b * kKeys + j;
    const T* kr = key < p.ctx ? p.k_cache + p.slots[key] * p.slot_row + g * hd : nullptr;
    const T* vr = key < p.ctx ? p.v_cache + p.slots[key] * p.slot_row + g * hd : nullptr;
    for (int64_t d = 0; d < hd; ++d) {
      kp[((d / kPair) * kKeys + j) * kPair + d % kPair] = kr ? kr[d] : T(0);
      // V: panel d / 64, input (key) j, channel d % 64
      vp[(d / kPanel) * kKeys * kPanel + ((j / kPair) * kPanel + d % kPanel) * kPair +
         j % kPair] = vr ? vr[d] : T(0);
    }
  }
}

template <typename T>
struct Scratch {
  alignas(64) T q[kMaxRows * 256];
  alignas(64) float s[kMaxRows * kKeys];
  alignas(64) T pr[kMaxRows * kKeys];
  alignas(64) float o[kMaxRows * 256];
  alignas(64) float sums[std::max(kRows, evenflow_panel::kAmxRows) * kPanel];
  // the AMX path's chunk of up to kChunkBlocks blocks: scores and probabilities
  alignas(64) float s_chunk[kMaxRows * kChunk];
  alignas(64) T p_chunk[kMaxRows * kChunk];
  float m[kMaxRows], l[kMaxRows], alpha[kMaxRows];
  int64_t pos[kMaxRows], head[kMaxRows];
};

template <typename T>
void finish_rows(const Problem<T>& p, int64_t rows, Scratch<T>& w);

// A task's rows: KV head g's query heads at positions [pos0, pos0 + npos), each row's query
// copied, its running max and sum reset, its output zeroed. How many rows.
template <typename T>
int64_t start_rows(const Problem<T>& p, int64_t g, int64_t pos0, int64_t npos, Scratch<T>& w) {
  const int64_t hd = p.hd, rows = npos * p.group;
  for (int64_t r = 0; r < rows; ++r) {
    w.pos[r] = pos0 + r / p.group;
    w.head[r] = g * p.group + r % p.group;
    std::memcpy(w.q + r * hd, p.q + w.pos[r] * p.q_row + w.head[r] * p.q_head, hd * sizeof(T));
    w.m[r] = -std::numeric_limits<float>::infinity();
    w.l[r] = 0.f;
  }
  std::memset(w.o, 0, sizeof(float) * rows * hd);
  return rows;
}

// One task: KV head g's query heads at positions [pos0, pos0 + npos).
template <typename T>
void run_tile(const Problem<T>& p, int64_t g, int64_t pos0, int64_t npos, Scratch<T>& w) {
  const int64_t hd = p.hd, rows = start_rows(p, g, pos0, npos, w);
  const T* qrow[kMaxRows];
  const T* prow[kMaxRows];
  for (int64_t r = 0; r < rows; ++r) {
    qrow[r] = w.q + r * hd;
    prow[r] = w.pr + r * kKeys;
  }
  const int64_t last_key = p.offset + pos0 + npos - 1;  // the last row's diagonal
  // the first row's window start: no earlier block is seen by any row of the tile
  const int64_t first_key = p.window ? std::max<int64_t>(0, p.offset + pos0 - p.window + 1) : 0;
  for (int64_t b = first_key / kKeys; b <= last_key / kKeys; ++b) {
    const int64_t key0 = b * kKeys;
    for (int64_t r0 = 0; r0 < rows; r0 += kRows)  // scores: q . k for 64 keys
      panel<T>(qrow + r0, static_cast<int>(std::min<int64_t>(kRows, rows - r0)),
               p.k_block(g, b), hd, w.s + r0 * kKeys);
    for (int64_t r = 0; r < rows; ++r) {  // online softmax
      const int64_t visible = std::min<int64_t>(kKeys, p.offset + w.pos[r] - key0 + 1);
      // keys of the block before this row's window (0 without a window)
      const int64_t hidden =
          p.window ? std::max<int64_t>(0, p.offset + w.pos[r] - p.window + 1 - key0) : 0;
      const float* s = w.s + r * kKeys;
      T* pr = w.pr + r * kKeys;
      if (visible <= 0 || hidden >= visible) {  // past the diagonal, or before the window
        for (int j = 0; j < kKeys; ++j) pr[j] = T(0);
        w.alpha[r] = 1.f;
        continue;
      }
      const float minus_inf = -std::numeric_limits<float>::infinity();
      f16v sv[kKeys / kLanes];
      f16v top = splat(minus_inf);
      for (int v = 0; v < kKeys / kLanes; ++v) {
        sv[v] = load(s + v * kLanes) * p.scale;
        if ((v + 1) * kLanes > visible) sv[v] = kLaneIndex + float(v * kLanes) < float(visible)
                                                    ? sv[v] : splat(minus_inf);
        if (v * kLanes < hidden) sv[v] = kLaneIndex + float(v * kLanes) >= float(hidden)
                                             ? sv[v] : splat(minus_inf);
        top = top > sv[v] ? top : sv[v];
      }
      float block_max = top[0];
      for (int i = 1; i < kLanes; ++i) block_max = std::max(block_max, top[i]);
      const float m_new = std::max(w.m[r], block_max);
      const float alpha = std::exp(w.m[r] - m_new);  // 0 on the first block (m = -inf)
      f16v total = splat(0.f);
      for (int v = 0; v < kKeys / kLanes; ++v) {
        f16v e = exp_nonpositive(sv[v] - m_new);
        if ((v + 1) * kLanes > visible || v * kLanes < hidden)
          e = sv[v] == minus_inf ? splat(0.f) : e;
        total += e;
        store_p(pr + v * kLanes, e);
      }
      float sum = 0.f;
      for (int i = 0; i < kLanes; ++i) sum += total[i];
      w.l[r] = w.l[r] * alpha + sum;
      w.m[r] = m_new;
      w.alpha[r] = alpha;
    }
    const T* vb = p.v_block(g, b);
    for (int64_t c = 0; c < hd / kPanel; ++c) {  // output += P @ V, one 64-channel panel at a time
      for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
        const int mr = static_cast<int>(std::min<int64_t>(kRows, rows - r0));
        panel<T>(prow + r0, mr, vb + c * kKeys * kPanel, kKeys, w.sums);
        for (int r = 0; r < mr; ++r) {
          float* o = w.o + (r0 + r) * hd + c * kPanel;
          const f16v a = splat(w.alpha[r0 + r]);
          for (int v = 0; v < kPanel; v += kLanes)
            store(o + v, load(o + v) * a + load(w.sums + r * kPanel + v));
        }
      }
    }
  }
  finish_rows(p, rows, w);
}

// Each row's output divided by its softmax sum (a sink's logit joining the max and the sum),
// rounded once into the output.
template <typename T>
void finish_rows(const Problem<T>& p, int64_t rows, Scratch<T>& w) {
  const int64_t hd = p.hd;
  for (int64_t r = 0; r < rows; ++r) {
    float inv = 1.f / w.l[r];
    if (p.sinks != nullptr) {  // the sink's logit joins the max and the sum, with no value
      const float sink = p.sinks[w.head[r]], m = std::max(w.m[r], sink);
      const float kept = std::exp(w.m[r] - m);
      inv = kept / (w.l[r] * kept + std::exp(sink - m));
    }
    T* dst = p.out + (w.pos[r] * p.heads + w.head[r]) * hd;
    for (int64_t d = 0; d < hd; ++d) from_f(w.o[r * hd + d] * inv, dst + d);
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)  // (its AVX-512 code needs AMX's CPU)
// One task on AMX tiles (bf16, kernels/panel_amx.h): as run_tile, but q.K and P.V on tiles,
// 16 rows a pass (q and P are rows one after another in the scratch, K's and V's blocks are
// panels: AMX's B layout; rows past the task's are read and their sums dropped), and the keys
// taken kChunkBlocks blocks at a time.
void run_tile_tiles(const Problem<uint16_t>& p, int64_t g, int64_t pos0, int64_t npos,
                    Scratch<uint16_t>& w) {
  namespace ep = evenflow_panel;
  constexpr int kT = ep::kAmxRows;
  const int64_t hd = p.hd, rows = start_rows(p, g, pos0, npos, w);
  const int64_t last_key = p.offset + pos0 + npos - 1;  // the last row's diagonal
  const int64_t first_key = p.window ? std::max<int64_t>(0, p.offset + pos0 - p.window + 1) : 0;
  const int64_t b_last = last_key / kKeys;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  ep::configure_tiles();
  for (int64_t b0 = first_key / kKeys; b0 <= b_last; b0 += kChunkBlocks) {
    const int64_t nb = std::min<int64_t>(kChunkBlocks, b_last - b0 + 1);
    const int64_t width = nb * kKeys, key0 = b0 * kKeys;
    for (int64_t r0 = 0; r0 < rows; r0 += kT) {  // scores: q . k, a block at a time
      for (int64_t bi = 0; bi < nb; ++bi) {
        ep::tiles_zero();
        ep::tiles_accumulate(w.q + r0 * hd, hd, p.k_block(g, b0 + bi), hd);
        ep::tiles_store(w.s_chunk + r0 * kChunk + bi * kKeys, kChunk);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {  // online softmax over the chunk's keys
      const int64_t visible = std::min<int64_t>(width, p.offset + w.pos[r] - key0 + 1);
      const int64_t hidden =
          p.window ? std::max<int64_t>(0, p.offset + w.pos[r] - p.window + 1 - key0) : 0;
      float* s = w.s_chunk + r * kChunk;
      uint16_t* pr = w.p_chunk + r * kChunk;
      if (visible <= 0 || hidden >= visible) {  // past the diagonal, or before the window
        std::memset(pr, 0, width * sizeof(uint16_t));
        w.alpha[r] = 1.f;
        continue;
      }
      __m512 top = _mm512_set1_ps(minus_inf);
      for (int64_t v = 0; v < width; v += kLanes) {
        f16v sv = load(s + v) * p.scale;
        if (v + kLanes > visible || v < hidden) {
          const f16v at = kLaneIndex + float(v);
          sv = at < float(visible) && at >= float(hidden) ? sv : splat(minus_inf);
        }
        store(s + v, sv);
        top = _mm512_max_ps(top, reinterpret_cast<__m512>(sv));
      }
      const float m_new = std::max(w.m[r], _mm512_reduce_max_ps(top));
      const float alpha = std::exp(w.m[r] - m_new);  // 0 on the first chunk (m = -inf)
      __m512 total = _mm512_setzero_ps();
      for (int64_t v = 0; v < width; v += kLanes) {
        const f16v sv = load(s + v);
        f16v e = exp_nonpositive(sv - m_new);
        e = sv == minus_inf ? splat(0.f) : e;
        total = _mm512_add_ps(total, reinterpret_cast<__m512>(e));
        store_p(pr + v, e);
      }
      w.l[r] = w.l[r] * alpha + _mm512_reduce_add_ps(total);
      w.m[r] = m_new;
      w.alpha[r] = alpha;
    }
    for (int64_t c = 0; c < hd / kPanel; ++c) {  // output += P @ V, a 64-channel panel at a time
      for (int64_t r0 = 0; r0 < rows; r0 += kT) {
        ep::tiles_zero();
        for (int64_t bi = 0; bi < nb; ++bi)
          ep::tiles_accumulate(w.p_chunk + r0 * kChunk + bi * kKeys, kChunk,
                               p.v_block(g, b0 + bi) + c * kKeys * kPanel, kKeys);
        ep::tiles_store(w.sums, kPanel);
        const int mr = static_cast<int>(std::min<int64_t>(kT, rows - r0));
        for (int r = 0; r < mr; ++r) {
          float* o = w.o + (r0 + r) * hd + c * kPanel;
          const f16v a = splat(w.alpha[r0 + r]);
          for (int v = 0; v < kPanel; v += kLanes)
            store(o + v, load(o + v) * a + load(w.sums + r * kPanel + v));
        }
      }
    }
  }
  ep::release_tiles();
  finish_rows(p, rows, w);
}
#endif

template <typename T>
void run(Problem<T>& p) {
  at::parallel_for(0, p.kv_heads * p.blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) pack_block(p, t / p.blocks, t % p.blocks);
  });
  const bool amx = std::is_same_v<T, uint16_t> && p.hd % 32 == 0 && evenflow_panel::amx_usable();
  // positions a task
  const int64_t per_tile = std::max<int64_t>(1, (amx ? kTileRowsAmx : kTileRows) / p.group);
  const int64_t tiles = (p.q_len + per_tile - 1) / per_tile;
  const int64_t tasks = tiles * p.kv_heads;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    auto scratch = std::make_unique<Scratch<T>>();
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) {
      const int64_t tile = tiles - 1 - t / p.kv_heads;  // the latest positions first
      const int64_t pos0 = tile * per_tile;
      const int64_t npos = std::min(per_tile, p.q_len - pos0);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      if constexpr (std::is_same_v<T, uint16_t>) {
        if (amx) {
          run_tile_tiles(p, t % p.kv_heads, pos0, npos, *scratch);
          continue;
        }
      }
#endif
      run_tile(p, t % p.kv_heads, pos0, npos, *scratch);
    }
  });
}

}  // namespace

namespace evenflow_ops {

// q (q_len, heads, hd) — any row and head strides, unit stride within a head; k_cache and
// v_cache (slots, kv_heads, hd); slots (ctx,) int64, the context's cache slots in token order
// (ctx >= q_len: the queries are the context's last q_len tokens) -> (q_len, heads, hd).
// window: a sliding window in tokens (0: none); sinks: (heads,) float32 logits, or none.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& slots, double scale,
                             int64_t window, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "prefill_attention: q must be (T, heads, hd)");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "prefill_attention: caches must be contiguous (slots, kv_heads, hd)");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() &&
                  q.scalar_type() == v_cache.scalar_type(),
              "prefill_attention: q and the caches must share a dtype");
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || q.scalar_type() == at::kFloat, "prefill_attention: bf16 or float32");
  TORCH_CHECK(!bf16 || kHasBf16Dot, "bfloat16 prefill attention needs AVX512-BF16");
  const int64_t hd = q.size(2), heads = q.size(1), kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == hd && hd % kPanel == 0 && hd <= 256,
              "prefill_attention: head dim must be 64, 128, 192 or 256");
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxRows,
              "prefill_attention: at most 64 query heads a KV head");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.size(0) >= q.size(0),
              "prefill_attention: slots must be a contiguous int64 vector of >= T entries");
  TORCH_CHECK(window >= 0, "prefill_attention: window must be >= 0");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat &&
                                     sinks->is_contiguous() && sinks->numel() == heads),
              "prefill_attention: sinks must be a contiguous float32 vector, one a head");
  at::Tensor out = at::empty({q.size(0), heads, hd}, q.options());
  if (q.size(0) == 0) return out;
  const int64_t ctx = slots.size(0), blocks = (ctx + kKeys - 1) / kKeys;
  at::Tensor kpack = at::empty({kv_heads, blocks, kKeys * hd}, q.options());
  at::Tensor vpack = at::empty({kv_heads, blocks, kKeys * hd}, q.options());
  auto fill = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    Problem<T> p{};
    p.q = static_cast<const T*>(q.data_ptr());
    p.q_row = q.stride(0);
    p.q_head = q.stride(1);
    p.k_cache = static_cast<const T*>(k_cache.data_ptr());
    p.v_cache = static_cast<const T*>(v_cache.data_ptr());
    p.slot_row = kv_heads * hd;
    p.slots = slots.data_ptr<int64_t>();
    p.ctx = ctx;
    p.q_len = q.size(0);
    p.offset = ctx - q.size(0);
    p.heads = heads;
    p.kv_heads = kv_heads;
    p.group = heads / kv_heads;
    p.hd = hd;
    p.blocks = blocks;
    p.scale = static_cast<float>(scale);
    p.window = window;
    p.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
    p.kpack = static_cast<T*>(kpack.data_ptr());
    p.vpack = static_cast<T*>(vpack.data_ptr());
    p.out = static_cast<T*>(out.data_ptr());
    run(p);
  };
  if (bf16) {
    fill(static_cast<uint16_t*>(nullptr));
  } else {
    fill(static_cast<float*>(nullptr));
  }
  return out;
}

}  // namespace evenflow_ops

TORCH_LIBRARY_FRAGMENT(evenflow_kernels, m) {
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, "
        "float scale, int window=0, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(evenflow_kernels, CPU, m) {
  m.impl("prefill_attention", &evenflow_ops::prefill_attention);
}
