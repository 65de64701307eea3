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
// Threads: ATen's pool, one task per (sequence, KV head). Compiled at first use with
// -march=native by evenflow/engine/native.py, next to the weight-only kernels.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "panel.h"

namespace {

// vector types and helpers shared with the panel kernels (kernels/panel.h)
using evenflow_panel::f16v;
using evenflow_panel::kLanes;
using evenflow_panel::load;
using evenflow_panel::splat;
using evenflow_panel::store;
using evenflow_panel::u16v;
typedef uint16_t u16x16 __attribute__((vector_size(32)));  // 16 x bf16 bits

// n values (n a multiple of 16) widened to float32
inline void to_float(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; i += kLanes) {
    u16x16 h;
    std::memcpy(&h, bits + i, sizeof h);
    u16v w = __builtin_convertvector(h, u16v) << 16;
    std::memcpy(dst + i, &w, sizeof w);
  }
}

using evenflow_panel::exp_nonpositive;  // e^x for x <= 0, 16 lanes (kernels/panel.h)

inline float hsum(f16v v) {
#if defined(__AVX512F__)
  __m512 m;
  std::memcpy(&m, &v, sizeof m);
  return _mm512_reduce_add_ps(m);
#else
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
}

template <typename T>
void decode_attention(const T* q, const T* k_cache, const T* v_cache, const int64_t* slots,
                      const int64_t* lens, T* out, int64_t batch, int64_t heads,
                      int64_t kv_heads, int64_t head_dim, int64_t width, float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t row = kv_heads * head_dim;  // one cache slot
  const int64_t vecs = head_dim / kLanes;
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
        to_float(k_cache + ctx[t] * row + g * head_dim, kf.data(), head_dim);
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
        float* si = scores.data() + i * padded;
        f16v sum = {};
        for (int64_t t = 0; t < padded; t += kLanes) {
          const f16v p = exp_nonpositive(load(si + t) - top[i]);
          store(si + t, p);
          sum += p;
        }
        total[i] = hsum(sum);
      }
      for (int64_t t = 0; t < len; ++t) {  // V read once, in place
        to_float(v_cache + ctx[t] * row + g * head_dim, kf.data(), head_dim);
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

// q (B, heads, hd); k_cache, v_cache (slots, kv_heads, hd); slots (B, L) int64, lens (B,)
// int64 with lens[b] <= L; all contiguous, q and the caches of one dtype (float32 or bf16).
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& slots,
                                  const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous (B, heads, hd) tensor");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes()
                  && v_cache.is_contiguous(),
              "the caches must be contiguous (slots, kv_heads, hd) tensors of one shape");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
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
  auto out = at::empty_like(q);
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    decode_attention<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(),
                            v_cache.data_ptr<float>(), slots.data_ptr<int64_t>(), lp,
                            out.data_ptr<float>(), batch, heads, kv_heads, head_dim, width, s);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_attention<c10::BFloat16>(
        q.data_ptr<c10::BFloat16>(), k_cache.data_ptr<c10::BFloat16>(),
        v_cache.data_ptr<c10::BFloat16>(), slots.data_ptr<int64_t>(), lp,
        out.data_ptr<c10::BFloat16>(), batch, heads, kv_heads, head_dim, width, s);
  } else {
    TORCH_CHECK(false, "paged_decode_attention takes float32 or bfloat16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(evenflow_kernels, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, "
        "Tensor lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(evenflow_kernels, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
