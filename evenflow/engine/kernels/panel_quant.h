// Quantized panels for the panel kernels (fused_moe.cpp, panel_linear.cpp): the stored forms,
// their direct kernels and their dequantization into a plain panel (panel_run.h's `run_panel`
// chooses between the two per block of rows).
//
// Stored forms (made by evenflow/engine/kernels/panels.py), panels of 64 output channels as in panel.h:
//   int8: (N/64, K, 64) int8, w = q * scale[n] (float32 (N,): applied to the sums);
//   int4: (N/64, K/2, 64) uint8, byte (kp, c) holds k = 2kp in its low nibble and 2kp + 1 in
//         its high one; w = q * scale + offset with float32 (N/64, G, 64) scale and offset per
//         (group of `group` inputs, channel).
//   int4 for int8 rows (kInt4Vnni, where VNNI is): (N/64, K/8, 64, 4) uint8, the dword of
//         (block j, channel c) holding k = 8j + i in byte i's low nibble and 8j + 4 + i in its
//         high one; scale and offset shaped as int4's, in float16. Few rows are quantized per group and meet it
//         on vpdpbusd (panel_w8a8.h's panel_w4a8), more rows a dequantized panel.
//   int5 for int8 rows (kInt5Vnni, where VNNI is): (N/64, K/8, 5, 64) uint8: per block j of 8
//         inputs, kInt4Vnni's 64 dwords (the codes' low four bits), then a byte per channel whose
//         bit i is the fifth bit of k = 8j + i; codes 0..31, scale and offset as kInt4Vnni's
//         (GGUF's 5-bit types as stored: 6 bits a weight).
//   mxfp4 (kMxfp4, where VNNI is): MXFP4's E2M1 codes in kInt4Vnni's layout, groups of 32,
//         with each (group, channel)'s E8M0 exponent byte (N/64, G, 64) uint8 and no offset:
//         4.25 bits a weight, as checkpoints ship them. Few rows meet it on vpdpbusd through a
//         code lookup (panel_w8a8.h), more rows a dequantized panel.
//   fp8 (kFp8): (N/64, K, 64) float8_e4m3fn, as int8's layout, with a float32 scale per (block
//         of 128 inputs, channel) (N/64, ceil(K/128), 64): FP8 block-wise checkpoints' bytes as
//         shipped. No fp8 arithmetic needed: bf16 rows meet the values looked up as bf16,
//         float rows them widened to float32 (panel_fp8.h).
//   w8a8: (N/64, K/4, 64, 4) int8 (four consecutive inputs of a channel side by side, for
//         VNNI's vpdpbusd), scale (N,) float32 and comp (N,) int32 = 128 * sum_k q[n, k]. The
//         rows are quantized too (per row, dynamic), so the sums are integer: panel_w8a8.h.
// Few rows (decode) read the quantized panel directly: each weight vector is widened to float
// in registers and meets every row with FMAs (float32 activations), so the weight is read once
// at its stored size. From kDequantRows rows on, the panel is first dequantized into a plain
// panel in the activations' dtype (a thread's scratch, L2-resident) and the plain kernel of
// panel.h runs over it: the widening is then paid once for many rows.

#pragma once

#include <cmath>
#include <memory>
#include <utility>

#include "panel.h"
#include "panel_amx.h"
#include "panel_fp8.h"
#include "panel_w8a8.h"

namespace evenflow_panel {

typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));

enum class Format { kPlain, kInt8, kInt4, kInt4Vnni, kInt5Vnni, kMxfp4, kFp8, kW8A8 };

// One weight (a dense layer's, or one expert's gate_up or down) as stored.
struct Weight {
  Format format = Format::kPlain;
  const void* data = nullptr;
  const float* scale = nullptr;   // int8: (N,); int4: (N/64, G, 64); fp8: (N/64, B, 64)
  const float* offset = nullptr;  // int4 only
  // kInt4Vnni, kInt5Vnni: scale and offset (N/64, G, 64) in float16 (half the bytes of float32, where a
  // batch-1 step reads them all)
  const uint16_t* scale_h = nullptr;
  const uint16_t* offset_h = nullptr;
  const int32_t* comp = nullptr;  // w8a8 only
  const uint8_t* exps = nullptr;  // kMxfp4 only: E8M0 exponents (N/64, G, 64)
  int64_t group = 0;              // int4, int5 and mxfp4
  // from this many rows a panel is dequantized into a plain one first (and, for w8a8 and the
  // VNNI int4 layouts, below it the rows meet the codes as int8): the weight's kernel plan,
  // measured once on the machine (engine/quant/panel_stack.py); 0: the built-in thresholds
  int64_t dequant_from = 0;
};

// The `group` argument of the panel ops: the quantization group in its low 32 bits, and the
// kernel plan's dequant_from (above) in bits 32-47 (fused_moe: its gate_up's; bits 48-62: its
// down's). Made by engine/kernels/panels.py group_word.
struct GroupWord {
  int64_t group, dequant_from, dequant_from2;
};
inline GroupWord split_group(int64_t word) {
  return {word & 0xffffffff, (word >> 32) & 0xffff, (word >> 48) & 0x7fff};
}

// the codes 0..15 / 0..31 in the VNNI layout (kInt4Vnni, kInt5Vnni), MXFP4's E2M1 codes in it
inline bool vnni_codes(Format f) {
  return f == Format::kInt4Vnni || f == Format::kInt5Vnni || f == Format::kMxfp4;
}

// bytes of one panel's weights (64 channels x k_total inputs; plain: `elem` bytes a weight)
inline int64_t panel_bytes(Format f, int64_t k_total, int64_t elem) {
  const int64_t weights = k_total * kPanel;
  if (f == Format::kPlain) return weights * elem;
  if (f == Format::kInt5Vnni) return weights / 8 * 5;
  if (f == Format::kInt4 || f == Format::kInt4Vnni || f == Format::kMxfp4) return weights / 2;
  return weights;  // int8, fp8, w8a8
}


#if defined(__AVX512F__)
constexpr int kQuantRows = 4;  // rows per register block over a quantized panel
#else
constexpr int kQuantRows = 1;
#endif
constexpr int64_t kDequantRows = 8;  // from this many rows on, dequantize the panel first
// int4 against bf16 rows on the bf16 dot product (panel_int4_bf16) stays direct longer: it beat
// dequantizing the panel up to 8 rows (1.5x) and lost from 16 (0.9x)
constexpr int64_t kDequantRowsInt4Dot = 16;
// int4 against grouped int8 rows (W4A8) up to this many rows; from there a dequantized panel
constexpr int64_t kDequantRowsW4A8 = 16;

// 16 int8 / uint8 values as float32 (intrinsics where AVX-512 has them: GCC's generic
// conversion of byte vectors goes lane by lane)
inline f16v widen(const int8_t* p) {
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  f16v v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#else
  i8x16 b;
  std::memcpy(&b, p, sizeof b);
  const i16v wide = __builtin_convertvector(b, i16v);
  return __builtin_convertvector(wide, f16v);
#endif
}

inline f16v widen_nibbles(u8x16 b) {
#if defined(__AVX512F__)
  __m128i bytes;
  std::memcpy(&bytes, &b, sizeof bytes);
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
  f16v v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#else
  const i16v wide = __builtin_convertvector(b, i16v);
  return __builtin_convertvector(wide, f16v);
#endif
}

template <int MR>
void panel_int8(const float* const* x, const int8_t* w, int64_t k_total, float* sums) {
  f16v acc[MR][4] = {};
  for (int64_t k = 0; k < k_total; ++k) {
    const int8_t* wp = w + k * kPanel;
    __builtin_prefetch(wp + kPrefetch);
    const f16v w0 = widen(wp), w1 = widen(wp + 16), w2 = widen(wp + 32), w3 = widen(wp + 48);
    fma_rows<MR>(acc, x, k, w0, w1, w2, w3);
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) store(sums + r * kPanel + v * kLanes, acc[r][v]);
}

// the low (k = 2kp) and high (k = 2kp + 1) weights of 16 channels, dequantized
inline void int4_pair(const uint8_t* p, f16v s, f16v o, f16v& low, f16v& high) {
  u8x16 b;
  std::memcpy(&b, p, sizeof b);
  low = widen_nibbles(b & 0xF) * s + o;
  high = widen_nibbles(b >> 4) * s + o;
}

template <int MR>
void panel_int4(const float* const* x, const uint8_t* w, const float* scale, const float* offset,
                int64_t k_total, int64_t group, float* sums) {
  f16v acc[MR][4] = {};
  for (int64_t g = 0; g < k_total / group; ++g) {
    f16v s[4], o[4];
    for (int v = 0; v < 4; ++v) {
      s[v] = load(scale + g * kPanel + v * kLanes);
      o[v] = load(offset + g * kPanel + v * kLanes);
    }
    for (int64_t kp = g * group / 2; kp < (g + 1) * group / 2; ++kp) {
      const uint8_t* wp = w + kp * kPanel;
      __builtin_prefetch(wp + kPrefetch);
      f16v xl[MR], xh[MR];
      for (int r = 0; r < MR; ++r) {
        xl[r] = splat(x[r][2 * kp]);
        xh[r] = splat(x[r][2 * kp + 1]);
      }
      for (int v = 0; v < 4; ++v) {
        f16v low, high;
        int4_pair(wp + v * kLanes, s[v], o[v], low, high);
        for (int r = 0; r < MR; ++r) acc[r][v] += xl[r] * low + xh[r] * high;
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) store(sums + r * kPanel + v * kLanes, acc[r][v]);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// int4 against bf16 activations with the bf16 dot product: per group, sum q * x (q exact in
// bf16, looked up from the nibbles with one word permute; `vdpbf16ps` takes the k = 2kp and
// 2kp + 1 products at once), then scale the group's sums and add offset * (the group's sum of
// x): w = q * s + o gives sum(w x) = s * sum(q x) + o * sum(x). Half the instructions of
// dequantizing each weight in float32, where one row made the int4 path compute-bound.
template <int MR>
void panel_int4_bf16(const uint16_t* const* x, const uint8_t* w, const float* scale,
                     const float* offset, int64_t k_total, int64_t group, float* sums) {
  // word i: bf16(i & 15). Index words come from (b | b << 12): the low word's bits 0-4 are
  // q_low plus q_high's lowest bit (16 more), the high word's are q_high.
  const __m512i table = _mm512_set_epi16(
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0,
      0x4080, 0x4040, 0x4000, 0x3F80, 0x0000, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120,
      0x4110, 0x4100, 0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
  // the totals live in `sums` (updated once a group): registers hold only the group's part
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v)
      _mm512_storeu_ps(sums + r * kPanel + v * kLanes, _mm512_setzero_ps());
  for (int64_t g = 0; g < k_total / group; ++g) {
    __m512 part[MR][4];
    float xsum[MR];
    for (int r = 0; r < MR; ++r) {
      __m512 t = _mm512_setzero_ps();
      for (int64_t k = g * group; k < (g + 1) * group; k += kLanes)
        t = _mm512_add_ps(t, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r] + k))),
                             16)));
      xsum[r] = _mm512_reduce_add_ps(t);
      for (int v = 0; v < 4; ++v) part[r][v] = _mm512_setzero_ps();
    }
    for (int64_t kp = g * group / 2; kp < (g + 1) * group / 2; ++kp) {
      const uint8_t* wp = w + kp * kPanel;
      __builtin_prefetch(wp + kPrefetch);
      __m512i xpair[MR];
      for (int r = 0; r < MR; ++r) {  // the rows' (x[2kp], x[2kp + 1]) as one bf16 pair
        int32_t pair;
        std::memcpy(&pair, x[r] + 2 * kp, sizeof pair);
        xpair[r] = _mm512_set1_epi32(pair);
      }
      for (int v = 0; v < 4; ++v) {
        const __m512i b = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + v * kLanes)));
        const __m512i q = _mm512_permutexvar_epi16(
            _mm512_or_si512(b, _mm512_slli_epi32(b, 12)), table);
        for (int r = 0; r < MR; ++r)
          part[r][v] = _mm512_dpbf16_ps(part[r][v], reinterpret_cast<__m512bh>(q),
                                        reinterpret_cast<__m512bh>(xpair[r]));
      }
    }
    for (int v = 0; v < 4; ++v) {
      const __m512 s = _mm512_loadu_ps(scale + g * kPanel + v * kLanes);
      const __m512 o = _mm512_loadu_ps(offset + g * kPanel + v * kLanes);
      for (int r = 0; r < MR; ++r) {
        float* total = sums + r * kPanel + v * kLanes;
        _mm512_storeu_ps(total, _mm512_fmadd_ps(o, _mm512_set1_ps(xsum[r]), _mm512_fmadd_ps(
                                    part[r][v], s, _mm512_loadu_ps(total))));
      }
    }
  }
}
#endif

inline void panel_w8a8_rows(const Weight& wt, int64_t p, const uint8_t* const* xq,
                            const float* row_scale, int m, int64_t k_total, float* sums) {
  panel_w8a8_rows(static_cast<const int8_t*>(wt.data) + p * kPanel * k_total,
                  wt.scale + p * kPanel, wt.comp + p * kPanel, xq, row_scale, m, k_total, sums);
}


template <int MR>
void panel_quant_rows(const Weight& wt, int64_t p, const float* const* x,
                      const uint16_t* const* xb, int64_t k_total, float* sums) {
  (void)xb;
  if (wt.format == Format::kFp8) {
    const int64_t blocks = (k_total + kFp8Block - 1) / kFp8Block;
    panel_fp8<MR>(x, static_cast<const uint8_t*>(wt.data) + p * kPanel * k_total,
                  wt.scale + p * blocks * kPanel, k_total, sums);
  } else if (wt.format == Format::kInt8) {
    panel_int8<MR>(x, static_cast<const int8_t*>(wt.data) + p * kPanel * k_total, k_total, sums);
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  } else if (xb != nullptr && wt.group % kLanes == 0) {
    const int64_t groups = k_total / wt.group;
    panel_int4_bf16<MR>(xb, static_cast<const uint8_t*>(wt.data) + p * kPanel * k_total / 2,
                        wt.scale + p * groups * kPanel, wt.offset + p * groups * kPanel,
                        k_total, wt.group, sums);
#endif
  } else {
    const int64_t groups = k_total / wt.group;
    panel_int4<MR>(x, static_cast<const uint8_t*>(wt.data) + p * kPanel * k_total / 2,
                   wt.scale + p * groups * kPanel, wt.offset + p * groups * kPanel, k_total,
                   wt.group, sums);
  }
}

// x: the rows in float32; xb: the same rows in bf16 when the activations are bf16 (int4 then
// takes the bf16 dot product), else nullptr
inline void panel_quant(const Weight& wt, int64_t p, const float* const* x,
                        const uint16_t* const* xb, int m, int64_t k_total, float* sums) {
  switch (m) {
    case 1: return panel_quant_rows<1>(wt, p, x, xb, k_total, sums);
#if defined(__AVX512F__)
    case 2: return panel_quant_rows<2>(wt, p, x, xb, k_total, sums);
    case 3: return panel_quant_rows<3>(wt, p, x, xb, k_total, sums);
    default: return panel_quant_rows<4>(wt, p, x, xb, k_total, sums);
#else
    default: return panel_quant_rows<1>(wt, p, x, xb, k_total, sums);
#endif
  }
}

inline u16v bf16_bits(f16v f) {  // round to nearest even (finite values)
  u16v u;
  std::memcpy(&u, &f, sizeof u);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}


// Panel p of a quantized weight as a plain panel of T (panel.h's layout). int8 stays unscaled
// (q is exact in bf16; the scale goes on the sums, as on the direct path).
// 16 float16 values as float32
inline f16v load_half(const uint16_t* p) {
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  f16v v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#else  // (kInt4Vnni needs AVX-512; this only keeps other builds compiling)
  f16v v;
  for (int i = 0; i < kLanes; ++i) {
    const uint32_t h = p[i], sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu,
                   man = h & 0x3FFu;
    float f;
    if (exp == 0) {
      f = std::ldexp(static_cast<float>(man), -24);
    } else if (exp == 31) {
      f = man ? NAN : INFINITY;
    } else {
      const uint32_t bits = ((exp + 112) << 23) | (man << 13);
      std::memcpy(&f, &bits, sizeof f);
    }
    v[i] = sign ? -f : f;
  }
  return v;
#endif
}

// the weights of k = 8j + i (i in 0..7) of 16 channels of a kInt4Vnni panel from its dwords
inline f16v vnni_nibbles(const uint8_t* dwords, int i) {
  u16v d;
  std::memcpy(&d, dwords, sizeof d);
  const u16v q = (d >> static_cast<uint32_t>(8 * (i % 4) + 4 * (i / 4))) & 0xFu;
  return __builtin_convertvector(q, f16v);
}

// 16 for each of 16 channels whose code for k = 8j + i has its fifth bit set (a kInt5Vnni
// block's bit bytes), else 0
inline f16v fifth_value(const uint8_t* bits, int i) {
  u8x16 b;
  std::memcpy(&b, bits, sizeof b);
  const i16v set = __builtin_convertvector((b >> static_cast<uint8_t>(i)) & 1, i16v) << 4;
  return __builtin_convertvector(set, f16v);
}

// the E2M1 values (not yet scaled) of k = 8j + i (i in 0..7) of 16 channels of a kMxfp4 panel
inline f16v mx_values(const uint8_t* dwords, int i) {
  u16v d;
  std::memcpy(&d, dwords, sizeof d);
  const u16v q = (d >> static_cast<uint32_t>(8 * (i % 4) + 4 * (i / 4))) & 0xFu;
#if defined(__AVX512F__)
  const __m512 table = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f,
                                      -1.5f, -2.f, -3.f, -4.f, -6.f);
  __m512i idx;
  std::memcpy(&idx, &q, sizeof idx);
  const __m512 f = _mm512_permutexvar_ps(idx, table);
  f16v v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#else  // (kMxfp4 needs AVX-512; this only keeps other builds compiling)
  static const float table[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                  -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
  f16v v;
  for (int l = 0; l < kLanes; ++l) v[l] = table[q[l]];
  return v;
#endif
}

// 16 E8M0 exponents as the floats 2^(e - 127) (e = 0, 2^-127, reads as 2^-126: below any
// weight's precision)
inline f16v mx_scale(const uint8_t* exps) {
  u8x16 b;
  std::memcpy(&b, exps, sizeof b);
  i16v e = __builtin_convertvector(b, i16v);
  e = e < 1 ? 1 : e;
  const i16v bits = e << 23;
  f16v v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// w8a8's codes (four inputs of a channel a dword) for inputs i and i + 1 of 16 channels' dwords
inline void w8a8_pair(const int8_t* dwords, int i, f16v& low, f16v& high) {
#if defined(__AVX512F__)
  const __m512i d = _mm512_loadu_si512(dwords);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_srai_epi32(
      _mm512_sllv_epi32(d, _mm512_set1_epi32(24 - 8 * i)), 24));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_srai_epi32(
      _mm512_sllv_epi32(d, _mm512_set1_epi32(16 - 8 * i)), 24));
  std::memcpy(&low, &lo, sizeof low);
  std::memcpy(&high, &hi, sizeof high);
#else  // (w8a8 needs AVX-512 VNNI; this only keeps other builds compiling)
  for (int c = 0; c < kLanes; ++c) {
    low[c] = dwords[4 * c + i];
    high[c] = dwords[4 * c + i + 1];
  }
#endif
}

template <typename T>
void dequantize_panel(const Weight& wt, int64_t p, int64_t k_total, T* dst) {
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512VBMI__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (wt.format == Format::kFp8) {
      const int64_t blocks = (k_total + kFp8Block - 1) / kFp8Block;
      return dequantize_fp8_bf16(static_cast<const uint8_t*>(wt.data) + p * kPanel * k_total,
                                 wt.scale + p * blocks * kPanel, k_total, dst);
    }
  }
#endif
  const int64_t groups =
      wt.format == Format::kInt4 || vnni_codes(wt.format) ? k_total / wt.group : 1;
  for (int64_t kp = 0; kp < k_total / 2; ++kp) {
    for (int v = 0; v < 4; ++v) {
      f16v low, high;
      if (wt.format == Format::kMxfp4) {
        const int64_t j = kp / 4, g = 8 * j / wt.group, at = (p * groups + g) * kPanel + v * kLanes;
        const uint8_t* dwords = static_cast<const uint8_t*>(wt.data) +
                                (p * k_total / 8 + j) * 4 * kPanel + v * 4 * kLanes;
        const int i = 2 * static_cast<int>(kp % 4);
        const f16v s = mx_scale(wt.exps + at);
        low = mx_values(dwords, i) * s;
        high = mx_values(dwords, i + 1) * s;
      } else if (wt.format == Format::kInt4Vnni || wt.format == Format::kInt5Vnni) {
        const bool five = wt.format == Format::kInt5Vnni;
        const int64_t j = kp / 4, g = 8 * j / wt.group, at = (p * groups + g) * kPanel + v * kLanes;
        const uint8_t* block = static_cast<const uint8_t*>(wt.data) +
                               (p * k_total / 8 + j) * (five ? 5 : 4) * kPanel;
        const uint8_t* dwords = block + v * 4 * kLanes;
        const int i = 2 * static_cast<int>(kp % 4);
        const f16v s = load_half(wt.scale_h + at), o = load_half(wt.offset_h + at);
        low = vnni_nibbles(dwords, i);
        high = vnni_nibbles(dwords, i + 1);
        if (five) {
          low += fifth_value(block + 4 * kPanel + v * kLanes, i);
          high += fifth_value(block + 4 * kPanel + v * kLanes, i + 1);
        }
        low = low * s + o;
        high = high * s + o;
      } else if (wt.format == Format::kFp8) {  // (2kp and 2kp + 1 share a block of 128)
        const uint8_t* q = static_cast<const uint8_t*>(wt.data) + p * kPanel * k_total;
        const int64_t blocks = (k_total + kFp8Block - 1) / kFp8Block;
        const f16v s = load(wt.scale + (p * blocks + 2 * kp / kFp8Block) * kPanel + v * kLanes);
        low = widen_fp8(q + 2 * kp * kPanel + v * kLanes) * s;
        high = widen_fp8(q + (2 * kp + 1) * kPanel + v * kLanes) * s;
      } else if (wt.format == Format::kW8A8) {  // (block kp / 2 of four inputs: 2kp % 4 = i)
        const int8_t* dwords = static_cast<const int8_t*>(wt.data) +
                               (p * k_total / 4 + kp / 2) * 4 * kPanel + v * 4 * kLanes;
        w8a8_pair(dwords, 2 * static_cast<int>(kp % 2), low, high);
      } else if (wt.format == Format::kInt8) {
        const int8_t* q = static_cast<const int8_t*>(wt.data) + p * kPanel * k_total;
        low = widen(q + 2 * kp * kPanel + v * kLanes);
        high = widen(q + (2 * kp + 1) * kPanel + v * kLanes);
      } else {
        const int64_t g = 2 * kp / wt.group;
        const int64_t at = (p * groups + g) * kPanel + v * kLanes;
        int4_pair(static_cast<const uint8_t*>(wt.data) + (p * k_total / 2 + kp) * kPanel +
                      v * kLanes,
                  load(wt.scale + at), load(wt.offset + at), low, high);
      }
      if constexpr (std::is_same_v<T, float>) {
        store(dst + 2 * kp * kPanel + v * kLanes, low);
        store(dst + (2 * kp + 1) * kPanel + v * kLanes, high);
      } else {  // (kp, c, 2): channel c's pair side by side, k = 2kp first
#if defined(__AVX512BF16__) && defined(__AVX512F__)
        __m512 lo, hi;
        std::memcpy(&lo, &low, sizeof lo);
        std::memcpy(&hi, &high, sizeof hi);
        store_bf16_pairs(dst + kp * 2 * kPanel + v * 2 * kLanes, lo, hi);
#else
        const u16v pair = bf16_bits(low) | (bf16_bits(high) << 16);
        std::memcpy(dst + kp * 2 * kPanel + v * 2 * kLanes, &pair, sizeof pair);
#endif
      }
    }
  }
}

// A weight from its tensors: plain in x's dtype, int8 (kChar), int4 nibbles (kByte; 4-D: the
// VNNI layout, with float16 scale and offset, 5-bit codes where its third dim is 5; with a uint8
// scale and no offset: MXFP4 codes and exponents), or w8a8 (kChar with an int32 `offset`: its comp).
inline Weight weight_of(const at::Tensor& data, const at::Tensor* scale, const at::Tensor* offset,
                        int64_t group) {
  Weight wt;
  wt.data = data.data_ptr();
  if (data.scalar_type() == at::kFloat8_e4m3fn) {
    wt.format = Format::kFp8;
    wt.scale = scale->data_ptr<float>();
    wt.group = group;
    return wt;
  }
  if (data.scalar_type() == at::kChar && offset != nullptr &&
      offset->scalar_type() == at::kInt) {
    wt.format = Format::kW8A8;
    wt.scale = scale->data_ptr<float>();
    wt.comp = offset->data_ptr<int32_t>();
  } else if (data.scalar_type() == at::kChar) {
    wt.format = Format::kInt8;
    wt.scale = scale->data_ptr<float>();
  } else if (data.scalar_type() == at::kByte && data.dim() == 4 && scale != nullptr &&
             scale->scalar_type() == at::kByte) {
    wt.format = Format::kMxfp4;
    wt.exps = scale->data_ptr<uint8_t>();
    wt.group = group;
  } else if (data.scalar_type() == at::kByte && data.dim() == 4) {
    wt.format = data.size(2) == 5 && data.size(3) == kPanel ? Format::kInt5Vnni
                                                             : Format::kInt4Vnni;
    wt.scale_h = reinterpret_cast<const uint16_t*>(scale->data_ptr());
    wt.offset_h = reinterpret_cast<const uint16_t*>(offset->data_ptr());
    wt.group = group;
  } else if (data.scalar_type() == at::kByte) {
    wt.format = Format::kInt4;
    wt.scale = scale->data_ptr<float>();
    wt.offset = offset->data_ptr<float>();
    wt.group = group;
  }
  return wt;
}

}  // namespace evenflow_panel
