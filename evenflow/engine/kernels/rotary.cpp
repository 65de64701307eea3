// Rotary embedding and the KV-cache write of a decode step in one pass: from the fused qkv
// projection's output, q and k are rotated (x * cos + roll(x, hd/2) * sin, sin's first half
// negated, as engine/model/rotary.py writes it), k and v go to their cache slots, and q comes back
// contiguous for the attention kernel. It replaces ~8 small ops per layer (two multiplies, a
// roll, an add, slicing, two index_copy_). Each product and the sum are rounded to the input
// dtype, as the separate torch ops round them, so the result is bit-identical. Vectorized where
// half a head is a multiple of 16 (c10::BFloat16's scalar conversions took ~60 us a layer at
// batch 32).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "ops.h"
#include "panel.h"

// (no fused multiply-add anywhere here: torch rounds each product before the sum)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace {

using namespace evenflow_panel;

inline f16v rounded(f16v v, const float*) { return v; }
inline f16v rounded(f16v v, const c10::BFloat16*) { return bf16_round(v); }  // as a bf16 op

template <typename T>
inline T rotate(T x, T partner, T c, T s) {
  const T a = static_cast<T>(static_cast<float>(x) * static_cast<float>(c));
  const T b = static_cast<T>(static_cast<float>(partner) * static_cast<float>(s));
  return static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
}

template <typename T>
void rotary_rows(const T* qkv, const T* cos, const T* sin, T* k_cache, T* v_cache,
                 const int64_t* slots, T* q_out, int64_t tokens, int64_t heads,
                 int64_t kv_heads, int64_t hd) {
  const int64_t half = hd / 2, width = (heads + 2 * kv_heads) * hd;
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = qkv + t * width;
      const T* c = cos + t * hd;
      const T* s = sin + t * hd;
      T* k_dst = k_cache + slots[t] * kv_heads * hd;
      T* v_dst = v_cache + slots[t] * kv_heads * hd;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        const T* x = row + h * hd;
        T* dst = h < heads ? q_out + (t * heads + h) * hd : k_dst + (h - heads) * hd;
        if (half % kLanes == 0) {  // 16 lanes at a time, never straddling the halves
          for (int64_t i = 0; i < hd; i += kLanes) {
            const T* partner = x + (i < half ? i + half : i - half);
            const f16v a = rounded(load16(x + i) * load16(c + i), x);
            const f16v b = rounded(load16(partner) * load16(s + i), x);
            store16(dst + i, rounded(a + b, x));
          }
          continue;
        }
        for (int64_t i = 0; i < hd; ++i)
          dst[i] = rotate(x[i], x[i < half ? i + half : i - half], c[i], s[i]);
      }
      const T* v = row + (heads + kv_heads) * hd;
      for (int64_t i = 0; i < kv_heads * hd; ++i) v_dst[i] = v[i];
    }
  });
}

}  // namespace

namespace evenflow_ops {

// qkv (T, heads + 2 kv_heads, hd) contiguous; cos, sin (T, hd) contiguous; caches (slots,
// kv_heads, hd); slot_mapping (T,) int64. Returns q (T, heads, hd).
at::Tensor rotary_kv_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& slot_mapping, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous() && qkv.size(1) == heads + 2 * kv_heads,
              "qkv must be a contiguous (T, heads + 2 kv_heads, hd) tensor");
  const int64_t tokens = qkv.size(0), hd = qkv.size(2);
  TORCH_CHECK(hd % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == tokens * hd &&
                  sin.numel() == tokens * hd,
              "cos and sin must be contiguous (T, hd)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  k_cache.size(1) == kv_heads && k_cache.size(2) == hd &&
                  v_cache.sizes() == k_cache.sizes(),
              "the caches must be contiguous (slots, kv_heads, hd)");
  TORCH_CHECK(slot_mapping.is_contiguous() && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.numel() == tokens,
              "slot_mapping must be a contiguous (T,) int64 tensor");
  for (const auto* t : {&cos, &sin, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type(), "all tensors must share qkv's dtype");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t capacity = k_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < capacity, "a slot lies outside the cache");
  auto q = at::empty({tokens, heads, hd}, qkv.options());
  if (qkv.scalar_type() == at::kFloat) {
    rotary_rows<float>(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                       k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), slots,
                       q.data_ptr<float>(), tokens, heads, kv_heads, hd);
  } else if (qkv.scalar_type() == at::kBFloat16) {
    using B = c10::BFloat16;
    rotary_rows<B>(qkv.data_ptr<B>(), cos.data_ptr<B>(), sin.data_ptr<B>(),
                   k_cache.data_ptr<B>(), v_cache.data_ptr<B>(), slots, q.data_ptr<B>(),
                   tokens, heads, kv_heads, hd);
  } else {
    TORCH_CHECK(false, "rotary_kv_write takes float32 or bfloat16");
  }
  return q;
}

}  // namespace evenflow_ops

#pragma GCC pop_options

TORCH_LIBRARY_FRAGMENT(evenflow_kernels, m) {
  m.def("rotary_kv_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor slot_mapping, int heads, int kv_heads) -> Tensor");
}

TORCH_LIBRARY_IMPL(evenflow_kernels, CPU, m) {
  m.impl("rotary_kv_write", &evenflow_ops::rotary_kv_write);
}
