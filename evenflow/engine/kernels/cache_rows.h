// What the attention kernels share about reading cache rows: bf16 / float32 / int8 rows widened
// to float32, an int8 cache's per-(block, KV head) scales, and the horizontal reductions of
// the score loops (paged_attention.cpp, mla_decode.cpp).

#pragma once

#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "panel.h"

namespace evenflow_cache_rows {

using evenflow_panel::f16v;
using evenflow_panel::kLanes;
using evenflow_panel::load;
using evenflow_panel::load16;
using evenflow_panel::splat;
using evenflow_panel::store;
using evenflow_panel::u16v;
using evenflow_panel::u16x16;

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

typedef int8_t i8x16 __attribute__((vector_size(16)));

// An int8 cache's (kv_cache_dtype="int8") per-(block, KV head) scales: slot s of KV head g
// dequantizes by at[(s / block_size) * kv_heads + g] (the pointer is already offset by g).
// Float caches pass none.
struct CacheScales {
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t block_size = 1;
  int64_t kv_heads = 1;
  int shift = -1;  // log2(block_size) when a power of two: a shift, not a division per token
  float of(const float* at, int64_t slot) const {
    return at[(shift >= 0 ? slot >> shift : slot / block_size) * kv_heads];
  }
};

// 16 values of a cache row as float32, times the row's scale (int8 caches only)
template <typename C>
inline f16v load_cache(const C* p, float /*scale*/) {
  return load16(p);
}

inline f16v load_cache(const int8_t* p, float scale) {
#if defined(__AVX512F__)  // sign-extend and convert in two instructions
  const __m512 w = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  f16v x;
  std::memcpy(&x, &w, sizeof x);
#else
  i8x16 h;
  std::memcpy(&h, p, sizeof h);
  const f16v x = __builtin_convertvector(h, f16v);
#endif
  return scale == 1.f ? x : x * scale;
}

inline void to_float(const int8_t* src, float* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; i += kLanes) store(dst + i, load_cache(src + i, scale));
}

template <typename C>
inline void to_float(const C* src, float* dst, int64_t n, float /*scale*/) {
  to_float(src, dst, n);
}

template <typename C>
inline float row_scale(const float* at, const CacheScales& scales, int64_t slot) {
  if constexpr (std::is_same_v<C, int8_t>) return scales.of(at, slot);
  return 1.f;
}

inline float hsum_max(f16v v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

inline float hsum(f16v v) {
#if defined(__AVX512F__)
  __m512 m;
  std::memcpy(&m, &v, sizeof m);
  return _mm512_reduce_add_ps(m);
#else
  typedef float f8v __attribute__((vector_size(32)));
  typedef float f4v __attribute__((vector_size(16)));
  const f8v h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f4v q =
      __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
#endif
}

// lane t of the result = the sum of r[t]'s 16 lanes: four shuffle-and-add levels for all 16
// rows at once (each level halves the vectors and doubles what each lane has summed), instead
// of one horizontal reduction - a chain of ~8 dependent steps - per row
inline f16v row_sums(const f16v* r) {
  f16v x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)  // even lanes: r[2i]'s pair sums, odd lanes: r[2i + 1]'s
    x[i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24,
                                   10, 26, 12, 28, 14, 30) +
           __builtin_shufflevector(r[2 * i], r[2 * i + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25,
                                   11, 27, 13, 29, 15, 31);
  for (int i = 0; i < 4; ++i)  // each 4 lanes: partial sums of r[4i] .. r[4i + 3]
    y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9,
                                   24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(x[2 * i], x[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11,
                                   26, 27, 14, 15, 30, 31);
  for (int i = 0; i < 2; ++i)  // lanes 0-3 and 8-11: r[8i] .. r[8i + 3]; 4-7, 12-15: the rest
    z[i] = __builtin_shufflevector(y[2 * i], y[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9,
                                   10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(y[2 * i], y[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13,
                                   14, 15, 28, 29, 30, 31);
  return __builtin_shufflevector(z[0], z[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                 22, 23) +
         __builtin_shufflevector(z[0], z[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                                 29, 30, 31);
}

}  // namespace evenflow_cache_rows
