// Decode attention straight over the paged KV cache: for each decoding sequence b and KV head
// g, the queries of that head's group attend to the sequence's first lens[b] cache slots
// (slots[b, :lens[b]], in token order), reading K and V where they lie in the cache.
//
// Why: the torch path gathers every sequence's K and V into a padded (B, n_kv, L, hd) copy
// (two index_select per layer) and then runs scaled_dot_product_attention with an additive
// mask over the padding: at decode that is two copies of the context per layer plus a handful
// of small ops. Here K and V are read once, in place, and padding is never touched.
//
// Softmax in float32, two passes over the scores (max, then exp/sum while V accumulates).
// Attention sinks (GPT-OSS): each head's learned logit joins the softmax's max and denominator
// and has no value. A sliding window is the caller's: it passes each sequence's last `window`
// slots (engine/model/attention.py).
// Threads: ATen's pool, one task per (sequence, KV head). Compiled at first use with
// -march=native by evenflow/engine/kernels/native.py, next to the weight-only kernels.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "cache_rows.h"
#include "panel.h"

namespace {

// vector types and helpers shared with the panel kernels (kernels/panel.h) and the MLA decode
// kernel (kernels/cache_rows.h)
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

// One (sequence, KV head) with its G queries and head_dim = 16 * V, every running value in
// registers (G * V <= 16 accumulators): scores 16 tokens at a time (their dot products summed
// by row_sums), the running max as a vector, V accumulated without touching memory.
// `scores`: a (G, padded) scratch.
template <typename T, typename C, int V, int G>
void attend_group(const T* q, const C* k_base, const C* v_base, const CacheScales& scales,
                  const float* ks, const float* vs, const int64_t* ctx, int64_t len,
                  int64_t row, float scale, const float* sinks, float* scores, T* out) {
  constexpr int hd = V * kLanes;
  constexpr bool kInt8 = std::is_same_v<C, int8_t>;
  alignas(64) float token_scale[kLanes] = {};  // int8: each of the 16 tokens' K scale
  const int64_t padded = (len + kLanes - 1) / kLanes * kLanes;
  f16v qv[G][V], top[G];
  for (int i = 0; i < G; ++i) {
    for (int v = 0; v < V; ++v) qv[i][v] = load16(q + i * hd + v * kLanes) * scale;
    top[i] = splat(-1e30f);
  }
  const f16v lane = f16v{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  for (int64_t t0 = 0; t0 < len; t0 += kLanes) {
    const int n = static_cast<int>(std::min<int64_t>(kLanes, len - t0));
    f16v part[G][kLanes];
    for (int t = 0; t < n; ++t) {
      const C* kr = k_base + ctx[t0 + t] * row;
      // an int8 row's scale multiplies its score once (below), not each of its values
      if constexpr (kInt8) token_scale[t] = scales.of(ks, ctx[t0 + t]);
      f16v kv[V];
      for (int v = 0; v < V; ++v) kv[v] = load_cache(kr + v * kLanes, 1.f);
      for (int i = 0; i < G; ++i) {
        f16v s = qv[i][0] * kv[0];
        for (int v = 1; v < V; ++v) s += qv[i][v] * kv[v];
        part[i][t] = s;
      }
    }
    for (int t = n; t < kLanes; ++t)
      for (int i = 0; i < G; ++i) part[i][t] = f16v{};
    const f16v real = lane < static_cast<float>(n) ? splat(1.f) : splat(0.f);
    for (int i = 0; i < G; ++i) {
      f16v s = row_sums(part[i]);
      if constexpr (kInt8) s *= load(token_scale);
      s = real > 0.f ? s : splat(-1e30f);  // padding: e^(-1e30 - max) = 0
      store(scores + i * padded + t0, s);
      top[i] = top[i] > s ? top[i] : s;
    }
  }
  f16v acc[G][V];
  float inv[G];
  for (int i = 0; i < G; ++i) {  // probabilities, and their sum
    const float m = sinks != nullptr ? std::max(hsum_max(top[i]), sinks[i]) : hsum_max(top[i]);
    float* si = scores + i * padded;
    f16v sum = {};
    for (int64_t t = 0; t < padded; t += kLanes) {
      const f16v p = exp_nonpositive(load(si + t) - m);
      store(si + t, p);
      sum += p;
    }
    const float total = hsum(sum) + (sinks != nullptr ? std::exp(sinks[i] - m) : 0.f);
    inv[i] = total > 0.f ? 1.f / total : 0.f;
    for (int v = 0; v < V; ++v) acc[i][v] = f16v{};
  }
  for (int64_t t = 0; t < len; ++t) {  // V read once, in place
    const C* vr = v_base + ctx[t] * row;
    const float vscale = row_scale<C>(vs, scales, ctx[t]);  // (1 for float caches)
    f16v vv[V];
    for (int v = 0; v < V; ++v) vv[v] = load_cache(vr + v * kLanes, 1.f);
    for (int i = 0; i < G; ++i) {  // an int8 row's scale rides on its probability
      const f16v p = splat(scores[i * padded + t] * vscale);
      for (int v = 0; v < V; ++v) acc[i][v] += p * vv[v];
    }
  }
  for (int i = 0; i < G; ++i) {
    alignas(64) float o[hd];
    for (int v = 0; v < V; ++v) store(o + v * kLanes, acc[i][v] * inv[i]);
    T* dst = out + i * hd;
    for (int d = 0; d < hd; ++d) dst[d] = static_cast<T>(o[d]);
  }
}

// the register-resident path for this head shape: a kernel for `sub` of a KV head's queries at
// a time (each call reads that head's K and V again, from cache), or no kernel (then the
// general loop below)
template <typename T, typename C>
using GroupKernel = void (*)(const T*, const C*, const C*, const CacheScales&, const float*,
                             const float*, const int64_t*, int64_t, int64_t, float, const float*,
                             float*, T*);

template <typename T, typename C>
struct GroupPath {
  GroupKernel<T, C> kernel = nullptr;
  int64_t sub = 0;
};

template <typename T, typename C = T>
GroupPath<T, C> group_path(int64_t head_dim, int64_t group) {
#if !defined(__AVX512F__)
  // AVX2's 16 registers cannot hold the accumulators (an AVX2 build of this path ran 0.35-0.65x
  // torch's gathered attention from batch 8 on, under the AVX2 emulation); the loop below serves
  (void)head_dim, (void)group;
  return {};
#else
  if (group < 1) return {};
  if (head_dim == 64) {  // up to 4 queries x 4 vectors of accumulators
    if (group % 4 == 0) return {attend_group<T, C, 4, 4>, 4};
    if (group % 2 == 0) return {attend_group<T, C, 4, 2>, 2};
    return {attend_group<T, C, 4, 1>, 1};
  }
  if (head_dim == 128) {  // up to 2 queries x 8 vectors
    if (group % 2 == 0) return {attend_group<T, C, 8, 2>, 2};
    return {attend_group<T, C, 8, 1>, 1};
  }
  return {};
#endif
}

template <typename T, typename C>
void decode_attention(const T* q, const C* k_cache, const C* v_cache, const CacheScales& scales,
                      const int64_t* slots, const int64_t* lens, T* out, int64_t batch,
                      int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t width,
                      float scale, const float* sinks) {
  const int64_t group = heads / kv_heads;
  const int64_t row = kv_heads * head_dim;  // one cache slot
  const int64_t vecs = head_dim / kLanes;
  if (const GroupPath<T, C> path = group_path<T, C>(head_dim, group); path.kernel != nullptr) {
    const int64_t subs = group / path.sub;  // tasks: (sequence, KV head, queries sub-group)
    at::parallel_for(0, batch * kv_heads * subs, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / (kv_heads * subs), g = task / subs % kv_heads;
        const int64_t first = (b * heads + g * group + task % subs * path.sub) * head_dim;
        const int64_t padded = (lens[b] + kLanes - 1) / kLanes * kLanes;
        scores.resize(path.sub * std::max<int64_t>(padded, kLanes));
        const int64_t head = g * group + task % subs * path.sub;
        path.kernel(q + first, k_cache + g * head_dim, v_cache + g * head_dim, scales,
                    scales.k + g, scales.v + g, slots + b * width, lens[b], row, scale,
                    sinks != nullptr ? sinks + head : nullptr, scores.data(), out + first);
      }
    });
    return;
  }
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, acc, scores, kf(head_dim), top, total;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, g = task % kv_heads;
      const int64_t len = lens[b];
      const int64_t padded = (len + kLanes - 1) / kLanes * kLanes;
      const int64_t* ctx = slots + b * width;
      qf.resize(group * head_dim);
      acc.assign(group * head_dim, 0.f);
      scores.assign(group * std::max<int64_t>(padded, kLanes), -1e30f);
      top.assign(group, -1e30f);
      total.assign(group, 0.f);
      for (int64_t i = 0; i < group; ++i) {  // this group's queries, pre-scaled
        to_float(q + (b * heads + g * group + i) * head_dim, qf.data() + i * head_dim,
                 head_dim);
        for (int64_t d = 0; d < head_dim; ++d) qf[i * head_dim + d] *= scale;
      }
      for (int64_t t = 0; t < len; ++t) {  // scores: K read once, in place
        to_float(k_cache + ctx[t] * row + g * head_dim, kf.data(), head_dim,
                 row_scale<C>(scales.k + g, scales, ctx[t]));
        for (int64_t i = 0; i < group; ++i) {
          const float* qi = qf.data() + i * head_dim;
          f16v s = {};
          for (int64_t v = 0; v < vecs; ++v)
            s += load(qi + v * kLanes) * load(kf.data() + v * kLanes);
          const float score = hsum(s);
          scores[i * padded + t] = score;
          top[i] = std::max(top[i], score);
        }
      }
      for (int64_t i = 0; i < group; ++i) {  // probabilities, 16 at a time
        const float sink = sinks != nullptr ? sinks[g * group + i] : -1e30f;
        top[i] = std::max(top[i], sink);
        float* si = scores.data() + i * padded;
        f16v sum = {};
        for (int64_t t = 0; t < padded; t += kLanes) {
          const f16v p = exp_nonpositive(load(si + t) - top[i]);
          store(si + t, p);
          sum += p;
        }
        total[i] = hsum(sum) + (sinks != nullptr ? std::exp(sink - top[i]) : 0.f);
      }
      for (int64_t t = 0; t < len; ++t) {  // V read once, in place
        to_float(v_cache + ctx[t] * row + g * head_dim, kf.data(), head_dim,
                 row_scale<C>(scales.v + g, scales, ctx[t]));
        for (int64_t i = 0; i < group; ++i) {
          const f16v p = splat(scores[i * padded + t]);
          float* a = acc.data() + i * head_dim;
          for (int64_t v = 0; v < vecs; ++v)
            store(a + v * kLanes, load(a + v * kLanes) + p * load(kf.data() + v * kLanes));
        }
      }
      for (int64_t i = 0; i < group; ++i) {
        T* dst = out + (b * heads + g * group + i) * head_dim;
        const float inv = total[i] > 0.f ? 1.f / total[i] : 0.f;
        for (int64_t d = 0; d < head_dim; ++d)
          dst[d] = static_cast<T>(acc[i * head_dim + d] * inv);
      }
    }
  });
}

}  // namespace

namespace evenflow_ops {

namespace {

// Checks what both entry points take; returns (batch, heads, kv_heads, head_dim, width).
std::array<int64_t, 5> check_decode_args(const at::Tensor& q, const at::Tensor& k_cache,
                                         const at::Tensor& v_cache, const at::Tensor& slots,
                                         const at::Tensor& lens) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous (B, heads, hd) tensor");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes()
                  && v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type(),
              "the caches must be contiguous (slots, kv_heads, hd) tensors of one shape and dtype");
  TORCH_CHECK(slots.dim() == 2 && slots.is_contiguous() && slots.scalar_type() == at::kLong &&
                  slots.size(0) == q.size(0),
              "slots must be a contiguous (B, L) int64 tensor");
  TORCH_CHECK(lens.dim() == 1 && lens.is_contiguous() && lens.scalar_type() == at::kLong &&
                  lens.size(0) == q.size(0),
              "lens must be a contiguous (B,) int64 tensor");
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1), width = slots.size(1);
  TORCH_CHECK(k_cache.size(2) == head_dim && heads % kv_heads == 0,
              "head sizes do not match");
  TORCH_CHECK(head_dim % kLanes == 0, "head_dim must be a multiple of 16");
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= width, "lens must lie in [0, L]");
  return {batch, heads, kv_heads, head_dim, width};
}

template <typename C>
at::Tensor run_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const CacheScales& scales, const at::Tensor& slots, const at::Tensor& lens,
                      double scale, const std::optional<at::Tensor>& sinks) {
  const auto [batch, heads, kv_heads, head_dim, width] =
      check_decode_args(q, k_cache, v_cache, slots, lens);
  const float* sink = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                    sinks->numel() == heads,
                "sinks must be a contiguous float32 vector of one logit a head");
    sink = sinks->data_ptr<float>();
  }
  auto out = at::empty_like(q);
  const float s = static_cast<float>(scale);
  const C* k = static_cast<const C*>(k_cache.data_ptr());
  const C* v = static_cast<const C*>(v_cache.data_ptr());
  if (q.scalar_type() == at::kFloat) {
    decode_attention<float, C>(q.data_ptr<float>(), k, v, scales, slots.data_ptr<int64_t>(),
                               lens.data_ptr<int64_t>(), out.data_ptr<float>(), batch, heads,
                               kv_heads, head_dim, width, s, sink);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_attention<c10::BFloat16, C>(q.data_ptr<c10::BFloat16>(), k, v, scales,
                                       slots.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                                       out.data_ptr<c10::BFloat16>(), batch, heads, kv_heads,
                                       head_dim, width, s, sink);
  } else {
    TORCH_CHECK(false, "paged_decode_attention takes float32 or bfloat16 queries");
  }
  return out;
}

}  // namespace

// q (B, heads, hd); k_cache, v_cache (slots, kv_heads, hd); slots (B, L) int64, lens (B,)
// int64 with lens[b] <= L; all contiguous, q and the caches of one dtype (float32 or bf16).
// sinks: (heads,) float32 logits joining each head's softmax, or none.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& slots,
                                  const at::Tensor& lens, double scale,
                                  const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and the caches must share a dtype");
  if (q.scalar_type() == at::kFloat)
    return run_decode<float>(q, k_cache, v_cache, CacheScales{}, slots, lens, scale, sinks);
  return run_decode<c10::BFloat16>(q, k_cache, v_cache, CacheScales{}, slots, lens, scale,
                                   sinks);
}

// The same over an int8 cache (kv_cache_dtype="int8"): k_scales, v_scales (blocks + 1,
// kv_heads) float32, slot s of head g dequantizing by scales[s / block_size, g].
at::Tensor paged_decode_attention_int8(const at::Tensor& q, const at::Tensor& k_cache,
                                       const at::Tensor& v_cache, const at::Tensor& k_scales,
                                       const at::Tensor& v_scales, const at::Tensor& slots,
                                       const at::Tensor& lens, double scale,
                                       int64_t block_size,
                                       const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(k_cache.scalar_type() == at::kChar, "the caches must be int8");
  TORCH_CHECK(block_size >= 1 && k_cache.size(0) <= (k_scales.size(0)) * block_size,
              "the scales must cover every block of the cache");
  for (const at::Tensor* t : {&k_scales, &v_scales})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->is_contiguous() &&
                    t->sizes() == k_scales.sizes() && t->size(1) == k_cache.size(1),
                "the scales must be contiguous (blocks + 1, kv_heads) float32 tensors");
  const bool power_of_two = (block_size & (block_size - 1)) == 0;
  const CacheScales scales{k_scales.data_ptr<float>(), v_scales.data_ptr<float>(), block_size,
                           k_cache.size(1),
                           power_of_two ? __builtin_ctzll(static_cast<uint64_t>(block_size))
                                        : -1};
  return run_decode<int8_t>(q, k_cache, v_cache, scales, slots, lens, scale, sinks);
}

}  // namespace evenflow_ops

TORCH_LIBRARY_FRAGMENT(evenflow_kernels, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, "
        "Tensor lens, float scale, Tensor? sinks=None) -> Tensor");
  m.def("paged_decode_attention_int8(Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor k_scales, Tensor v_scales, Tensor slots, Tensor lens, float scale, "
        "int block_size, Tensor? sinks=None) -> Tensor");
  // whether this head shape takes the register-resident path (then the kernel beats torch's
  // gathered attention at every batch size, not only at small ones)
  m.def("paged_attention_registers", [](int64_t head_dim, int64_t group) {
    return group_path<float>(head_dim, group).kernel != nullptr;
  });
}

TORCH_LIBRARY_IMPL(evenflow_kernels, CPU, m) {
  m.impl("paged_decode_attention", &evenflow_ops::paged_decode_attention);
  m.impl("paged_decode_attention_int8", &evenflow_ops::paged_decode_attention_int8);
}
