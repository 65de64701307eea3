// w8a8 for the panel kernels (panel_run.h runs it): activation rows quantized per token to
// unsigned bytes (`QuantRows`), and one panel of 64 output channels of int8 weights against up
// to kW8A8Rows of them on VNNI's vpdpbusd (int32 sums, exact), with the scales and the
// compensation applied in the epilogue.
//
// Panel layout (made by evenflow/engine/quant/panel_stack.py): (N/64, K/4, 64, 4) int8, four
// consecutive inputs of a channel side by side; scale (N,) float32; comp (N,) int32 =
// 128 * sum_k q[n, k] (the rows are offset by 128: vpdpbusd multiplies unsigned by signed).

#pragma once

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

#include "panel.h"

namespace evenflow_panel {

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
constexpr bool kHasVnni = true;
#else
constexpr bool kHasVnni = false;
#endif
constexpr int kW8A8Rows = 6;  // rows per register block over a w8a8 panel (24 accumulators)
constexpr int kPrefetchW8A8 = 2048;  // bytes ahead in a w8a8 weight stream

// Rows quantized for w8a8, dynamically per row (as vLLM's dynamic per-token int8): with
// a = max |x|, x ~ s * (q - 128) where s = a / 127 and q = round(x * 127 / a) + 128 in
// [1, 255] (unsigned: vpdpbusd multiplies unsigned bytes by signed ones; the weights' comp
// takes the 128 back out). A zero row is all 128 with s = 0.
//
// Or, for int4 weights on vpdpbusd (W4A8, as llama.cpp runs Q4_0 against Q8_0 activations:
// `quantize_rows_grouped`), per row and group of `group` inputs: s = max |x| / 127 over the
// group and q = round(x / s), signed, with the group's sum of x as s * sum(q) (the weights'
// offsets meet it).
struct QuantRow {
  const uint8_t* q;      // the row's bytes (grouped rows: signed)
  float scale;           // per-row quantization's scale
  const float* gscale;   // grouped: each group's scale
  const float* gsum;     // grouped: each group's s * sum(q)
};

struct QuantRows {
  std::unique_ptr<uint8_t[]> q;
  std::unique_ptr<float[]> scale;
  std::unique_ptr<float[]> gscale, gsum;  // grouped rows only: (m, k / group)
  int64_t k = 0, groups = 0;

  bool empty() const { return q == nullptr; }
  const uint8_t* row(int64_t i) const { return q.get() + i * k; }
  QuantRow at(int64_t i) const {
    if (q == nullptr) return {nullptr, 0.f, nullptr, nullptr};
    if (groups > 0) return {row(i), 0.f, gscale.get() + i * groups, gsum.get() + i * groups};
    return {row(i), scale[i], nullptr, nullptr};
  }
};

inline float load1(float v) { return v; }
inline float load1(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(__AVX512F__)
inline __m512 load16_ps(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16_ps(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#endif

// max |x| over n values
template <typename T>
float peak_of(const T* src, int64_t n) {
  float peak = 0.f;
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 top = _mm512_setzero_ps();
  for (; j + kLanes <= n; j += kLanes) top = _mm512_max_ps(top, _mm512_abs_ps(load16_ps(src + j)));
  peak = _mm512_reduce_max_ps(top);
#endif
  for (; j < n; ++j) peak = std::max(peak, std::fabs(load1(src[j])));
  return peak;
}

// One row: its scale, and its k values as unsigned bytes (vectorized where AVX-512 is: the
// rounding is the same, to nearest even, both ways).
template <typename T>
float quantize_row(const T* src, int64_t k, uint8_t* dst) {
  const float peak = peak_of(src, k);
  const float inv = peak > 0.f ? 127.f / peak : 0.f;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 scale = _mm512_set1_ps(inv);
  const __m512i offset = _mm512_set1_epi32(128);
  for (; j + kLanes <= k; j += kLanes) {
    const __m512i q = _mm512_add_epi32(
        _mm512_cvtps_epi32(_mm512_mul_ps(load16_ps(src + j), scale)), offset);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), _mm512_cvtepi32_epi8(q));
  }
#endif
  for (; j < k; ++j)  // (peak * inv rounds to 127 at most: no clamp needed)
    dst[j] = static_cast<uint8_t>(static_cast<int>(std::nearbyint(load1(src[j]) * inv)) + 128);
  return peak / 127.f;
}

template <typename T>
void quantize_rows(const T* x, int64_t m, int64_t k, QuantRows& out) {
  out.q.reset(new uint8_t[static_cast<size_t>(m * k)]);
  out.scale.reset(new float[static_cast<size_t>(m)]);
  out.k = k;
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      out.scale[i] = quantize_row(x + i * k, k, out.q.get() + i * k);
  });
}
// One row in groups of `group` (a multiple of 16 on AVX-512) as signed bytes, each group's
// scale and s * sum(q).
template <typename T>
void quantize_row_grouped(const T* src, int64_t k, int64_t group, int8_t* dst, float* gscale,
                          float* gsum) {
  for (int64_t g = 0; g < k / group; ++g) {
    const T* x = src + g * group;
    int8_t* q = dst + g * group;
    const float peak = peak_of(x, group);
    const float inv = peak > 0.f ? 127.f / peak : 0.f;
    int32_t total = 0;
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512 scale = _mm512_set1_ps(inv);
    __m512i sum = _mm512_setzero_si512();
    for (; j + kLanes <= group; j += kLanes) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16_ps(x + j), scale));
      sum = _mm512_add_epi32(sum, v);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j), _mm512_cvtepi32_epi8(v));
    }
    total = _mm512_reduce_add_epi32(sum);
#endif
    for (; j < group; ++j) {
      const int v = static_cast<int>(std::nearbyint(load1(x[j]) * inv));
      q[j] = static_cast<int8_t>(v);
      total += v;
    }
    gscale[g] = peak / 127.f;
    gsum[g] = gscale[g] * static_cast<float>(total);
  }
}

template <typename T>
void quantize_rows_grouped(const T* x, int64_t m, int64_t k, int64_t group, QuantRows& out) {
  out.q.reset(new uint8_t[static_cast<size_t>(m * k)]);
  out.groups = k / group;
  out.gscale.reset(new float[static_cast<size_t>(m * out.groups)]);
  out.gsum.reset(new float[static_cast<size_t>(m * out.groups)]);
  out.k = k;
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      quantize_row_grouped(x + i * k, k, group, reinterpret_cast<int8_t*>(out.q.get() + i * k),
                           out.gscale.get() + i * out.groups, out.gsum.get() + i * out.groups);
  });
}

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
// MR quantized rows against one w8a8 panel on vpdpbusd (64 multiply-adds an instruction, int32
// sums: exact), then sums = (acc - comp) * row scale * channel scale.
// acc += the four byte products of each lane (u8 of x, s8 of w). As inline assembly: GCC
// (13) moved the intrinsic's accumulators through the stack on every step of the MR = 6 loop
// (3x slower than the bf16 dot product's loop); the asm's tied operand keeps them in registers.
inline __m512i dpbusd(__m512i acc, __m512i x, __m512i w) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(w));
  return acc;
}

template <int MR>
void panel_w8a8(const uint8_t* const* xq, const float* row_scale, const int8_t* w,
                const float* scale, const int32_t* comp, int64_t k_total, float* sums) {
  __m512i acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_si512();
  for (int64_t kq = 0; kq < k_total / 4; ++kq) {
    const int8_t* wp = w + kq * 4 * kPanel;
    for (int line = 0; line < 4; ++line) __builtin_prefetch(wp + kPrefetchW8A8 + 64 * line);
    const __m512i w0 = _mm512_loadu_si512(wp);
    const __m512i w1 = _mm512_loadu_si512(wp + 64);
    const __m512i w2 = _mm512_loadu_si512(wp + 128);
    const __m512i w3 = _mm512_loadu_si512(wp + 192);
    for (int r = 0; r < MR; ++r) {
      int32_t quad;
      std::memcpy(&quad, xq[r] + 4 * kq, sizeof quad);
      const __m512i xv = _mm512_set1_epi32(quad);
      acc[r][0] = dpbusd(acc[r][0], xv, w0);
      acc[r][1] = dpbusd(acc[r][1], xv, w1);
      acc[r][2] = dpbusd(acc[r][2], xv, w2);
      acc[r][3] = dpbusd(acc[r][3], xv, w3);
    }
  }
  for (int r = 0; r < MR; ++r) {
    const __m512 rs = _mm512_set1_ps(row_scale[r]);
    for (int v = 0; v < 4; ++v) {
      const __m512i c = _mm512_loadu_si512(comp + v * kLanes);
      const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(scale + v * kLanes), rs);
      _mm512_storeu_ps(sums + r * kPanel + v * kLanes,
                       _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][v], c)), s));
    }
  }
}

// m (1..kW8A8Rows) quantized rows against one panel: its weights `w`, scales `s`, comps `c`
inline void panel_w8a8_rows(const int8_t* w, const float* s, const int32_t* c,
                            const uint8_t* const* xq, const float* row_scale, int m,
                            int64_t k_total, float* sums) {
  switch (m) {
    case 1: return panel_w8a8<1>(xq, row_scale, w, s, c, k_total, sums);
    case 2: return panel_w8a8<2>(xq, row_scale, w, s, c, k_total, sums);
    case 3: return panel_w8a8<3>(xq, row_scale, w, s, c, k_total, sums);
    case 4: return panel_w8a8<4>(xq, row_scale, w, s, c, k_total, sums);
    case 5: return panel_w8a8<5>(xq, row_scale, w, s, c, k_total, sums);
    default: return panel_w8a8<6>(xq, row_scale, w, s, c, k_total, sums);
  }
}

// int4 weights against grouped int8 rows (W4A8), float16 scale and offset per (group,
// channel). The panel's layout (N/64, K/8, 64, 4): the
// dword of (block j, channel c) holds inputs 8j .. 8j + 3 in its bytes' low nibbles and
// 8j + 4 .. 8j + 7 in their high ones, so one 64-byte load gives 16 channels x 8 inputs, two
// masks give vpdpbusd's operands (weights unsigned 0..15, rows signed). Per group:
// sum(w x) = s_w * s_x * sum(q_w q_x) + o_w * s_x * sum(q_x).
//
// kFive (kInt5Vnni): 5-bit codes 0..31 (GGUF's Q5_0 / Q5_1 / Q5_K values as stored). Each block
// j of a panel is 320 bytes: the 64 channels' nibble dwords as above, then a byte per channel
// whose bit i is the fifth bit of k = 8j + i. Two byte-mask tests add 16 where it is set, so
// the codes stay unsigned for vpdpbusd: 6 bits a weight with the float16 scale and offset.
//
// kMx: the nibbles are MXFP4's E2M1 codes (same layout, groups of 32) and `exps` holds each
// (group, channel)'s E8M0 exponent byte (N/64, G, 64): 4.25 bits a weight, as checkpoints
// ship them. One vpshufb per nibble vector looks each code up as u = 2 * e2m1 + 12 (0..24,
// unsigned for vpdpbusd), so w = (u - 12) * 2^(e - 128): s_w = 2^(e - 128), o_w = -12 s_w.
inline __m512i mx_codes_table() {  // vpshufb's table, per 128-bit lane: code -> 2 * e2m1 + 12
  return _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24,
                                              12, 11, 10, 9, 8, 6, 4, 0));
}

// 16 channels' E8M0 exponents as the float 2^(e - 128) (e = 0, 2^-127, reads as 0)
inline __m512 mx_scales(const uint8_t* exps) {
  const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(exps)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_sub_epi32(_mm512_max_epi32(e, _mm512_set1_epi32(1)), _mm512_set1_epi32(1)), 23));
}

// The fifth bits of 16 channels' codes, each channel's byte copied to the four bytes of its
// dword (byte i then tests bit i for the low nibbles, bit 4 + i for the high ones)
inline __m512i fifth_bits(const uint8_t* bits) {
  const __m512i spread = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));
  return _mm512_shuffle_epi8(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits))), spread);
}

template <int MR, bool kMx, bool kFive = false>
void panel_w4a8(const QuantRow* rows, const uint8_t* w, const uint16_t* scale,
                const uint16_t* offset, const uint8_t* exps, int64_t k_total, int64_t group,
                float* sums) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i table = mx_codes_table();
  const __m512i sixteen = _mm512_set1_epi8(16);
  const __m512i low_bit = _mm512_set1_epi32(0x08040201), high_bit = _mm512_set1_epi32(
      static_cast<int32_t>(0x80402010u));
  constexpr int kLines = kFive ? 5 : 4;  // 64-byte lines a block of 8 inputs
  // the totals live in `sums` (updated once a group): registers hold the group's int32 sums
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v)
      _mm512_storeu_ps(sums + r * kPanel + v * kLanes, _mm512_setzero_ps());
  for (int64_t g = 0; g < k_total / group; ++g) {
    __m512i acc[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_si512();
    for (int64_t j = g * group / 8; j < (g + 1) * group / 8; ++j) {
      const uint8_t* wp = w + j * kLines * kPanel;
      for (int line = 0; line < kLines; ++line)
        __builtin_prefetch(wp + kPrefetchW8A8 + 64 * line);
      __m512i xlo[MR], xhi[MR];
      for (int r = 0; r < MR; ++r) {
        int32_t lo, hi;
        std::memcpy(&lo, rows[r].q + 8 * j, sizeof lo);
        std::memcpy(&hi, rows[r].q + 8 * j + 4, sizeof hi);
        xlo[r] = _mm512_set1_epi32(lo);
        xhi[r] = _mm512_set1_epi32(hi);
      }
      for (int v = 0; v < 4; ++v) {
        const __m512i b = _mm512_loadu_si512(wp + v * 64);
        __m512i low = _mm512_and_si512(b, nibble);
        __m512i high = _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble);
        if constexpr (kMx) {
          low = _mm512_shuffle_epi8(table, low);
          high = _mm512_shuffle_epi8(table, high);
        }
        if constexpr (kFive) {
          const __m512i bits = fifth_bits(wp + 4 * kPanel + v * kLanes);
          low = _mm512_mask_add_epi8(low, _mm512_test_epi8_mask(bits, low_bit), low, sixteen);
          high = _mm512_mask_add_epi8(high, _mm512_test_epi8_mask(bits, high_bit), high,
                                      sixteen);
        }
        for (int r = 0; r < MR; ++r) {
          acc[r][v] = dpbusd(acc[r][v], low, xlo[r]);
          acc[r][v] = dpbusd(acc[r][v], high, xhi[r]);
        }
      }
    }
    for (int v = 0; v < 4; ++v) {
      __m512 s, o;
      if constexpr (kMx) {
        s = mx_scales(exps + g * kPanel + v * kLanes);
        o = _mm512_mul_ps(s, _mm512_set1_ps(-12.f));
      } else {
        s = _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + g * kPanel + v * kLanes)));
        o = _mm512_cvtph_ps(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(offset + g * kPanel + v * kLanes)));
      }
      for (int r = 0; r < MR; ++r) {
        float* total = sums + r * kPanel + v * kLanes;
        _mm512_storeu_ps(total, _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(acc[r][v]), _mm512_mul_ps(s, _mm512_set1_ps(rows[r].gscale[g])),
            _mm512_fmadd_ps(o, _mm512_set1_ps(rows[r].gsum[g]), _mm512_loadu_ps(total))));
      }
    }
  }
}

// m (1..kW4A8Rows) grouped rows against one int4 panel (scale `s`, offset `o`), a 5-bit one
// (`five`), or an MXFP4 panel (`exps` set: its exponents; s and o unused)
inline void panel_w4a8_rows(const uint8_t* w, const uint16_t* s, const uint16_t* o,
                            const uint8_t* exps, const QuantRow* rows, int m, int64_t k_total,
                            int64_t group, float* sums, bool five = false) {
  if (five) {
    switch (m) {
      case 1: return panel_w4a8<1, false, true>(rows, w, s, o, exps, k_total, group, sums);
      case 2: return panel_w4a8<2, false, true>(rows, w, s, o, exps, k_total, group, sums);
      case 3: return panel_w4a8<3, false, true>(rows, w, s, o, exps, k_total, group, sums);
      default: return panel_w4a8<4, false, true>(rows, w, s, o, exps, k_total, group, sums);
    }
  }
  if (exps != nullptr) {
    switch (m) {
      case 1: return panel_w4a8<1, true>(rows, w, s, o, exps, k_total, group, sums);
      case 2: return panel_w4a8<2, true>(rows, w, s, o, exps, k_total, group, sums);
      case 3: return panel_w4a8<3, true>(rows, w, s, o, exps, k_total, group, sums);
      default: return panel_w4a8<4, true>(rows, w, s, o, exps, k_total, group, sums);
    }
  }
  switch (m) {
    case 1: return panel_w4a8<1, false>(rows, w, s, o, exps, k_total, group, sums);
    case 2: return panel_w4a8<2, false>(rows, w, s, o, exps, k_total, group, sums);
    case 3: return panel_w4a8<3, false>(rows, w, s, o, exps, k_total, group, sums);
    default: return panel_w4a8<4, false>(rows, w, s, o, exps, k_total, group, sums);
  }
}
#else
inline void panel_w8a8_rows(const int8_t*, const float*, const int32_t*, const uint8_t* const*,
                            const float*, int, int64_t, float*) {
  TORCH_CHECK(false, "w8a8 panels need AVX512-VNNI");
}
inline void panel_w4a8_rows(const uint8_t*, const uint16_t*, const uint16_t*, const uint8_t*,
                            const QuantRow*, int, int64_t, int64_t, float*, bool = false) {
  TORCH_CHECK(false, "int4 panels for int8 rows need AVX512-VNNI");
}
#endif
constexpr int kW4A8Rows = 4;  // rows per register block over a W4A8 panel (16 accumulators)

}  // namespace evenflow_panel
