// FP8 e4m3 panels (panel_quant.h's kFp8: (N/64, K, 64) bytes as shipped, a float32 scale per
// (block of 128 inputs, channel)): the kernels that read them.
//
// - Float rows (float32 activations, or a CPU without AVX512-BF16 / VBMI): each byte widens to
//   float32 in registers (widen_fp8) and meets the rows with FMAs (panel_fp8).
// - bf16 rows, where AVX512-BF16 and VBMI are (kFp8Dot): e4m3 values are exact in bf16 (3
//   mantissa bits, exponents -9..8), so a byte becomes its bf16 bits by a table lookup
//   (vpermi2b takes a 7-bit index into 128 bytes: one lookup for the low bytes and one for the
//   high ones, the sign bit put back with one ternary logic op), and two more byte permutes
//   lay each channel's inputs 2kp and 2kp + 1 side by side for vdpbf16ps. 14 instructions turn
//   a pair of panel rows (128 weights) into 4 vectors of bf16 pairs; widening them to float32
//   took 16 instructions for 64 weights and then twice the FMAs.
//   - few rows (panel_fp8_dot): the unscaled values against the rows, per block of 128 inputs,
//     whose sums then take the block's scale per channel in float32;
//   - many rows (panel_fp8_dequant_dot, else dequantize_fp8_bf16): a plain bf16 panel for
//     panel.h's kernel, made while the first rows' pass reads it where it can. The table then
//     holds each value times the scale, rounded to bf16 once (as torch's dequantize-then-cast
//     rounds), wherever the 32 channels of a half panel share the block's scale (tile-wise
//     checkpoints: DeepSeek's 128 x 128 tiles, gate and up halves each within one tile). Other
//     scales are multiplied in float32 per channel.

#pragma once

#include <array>
#include <cmath>

#include "panel.h"

namespace evenflow_panel {

constexpr int64_t kFp8Block = 128;  // inputs a scale covers

// 16 float8_e4m3fn bytes as float32: the magnitude's 7 bits go to the top of a float32's
// exponent and mantissa (2^(e - 127) (1 + m / 8), or a float denormal for e = 0) and 2^120
// rebiases the exponent to e4m3's 7 (exactly, denormals included); the sign bit goes to bit
// 31. The bytes are sign-extended, so one shift puts the sign in bits 27-31 and the magnitude
// in 20-26, and one AND keeps bit 31 and the magnitude: 4 instructions for 16 weights (7 before,
// a third of a batch-1 step's time on FP8 weights). (NaN, 0x7F, never occurs in weights.)
inline f16v widen_fp8(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i bits =
      _mm512_and_si512(_mm512_slli_epi32(b, 20), _mm512_set1_epi32(static_cast<int>(0x87F00000u)));
  const __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
  f16v v;
  std::memcpy(&v, &f, sizeof v);
  return v;
#else  // (fp8 panels need AVX-512; this only keeps other builds compiling)
  f16v v;
  for (int i = 0; i < kLanes; ++i) {
    const uint32_t mag = static_cast<uint32_t>(p[i] & 0x7F) << 20;
    float f;
    std::memcpy(&f, &mag, sizeof f);
    v[i] = (p[i] & 0x80) ? -f * 0x1p120f : f * 0x1p120f;
  }
  return v;
#endif
}

// MR float rows against an fp8 panel: per block of 128 inputs, sum w x in registers, then add
// it times the block's scales into `sums`
template <int MR>
void panel_fp8(const float* const* x, const uint8_t* w, const float* scale, int64_t k_total,
               float* sums) {
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) store(sums + r * kPanel + v * kLanes, f16v{});
  for (int64_t b = 0; b * kFp8Block < k_total; ++b) {
    f16v acc[MR][4] = {};
    const int64_t end = std::min(k_total, (b + 1) * kFp8Block);
    for (int64_t k = b * kFp8Block; k < end; ++k) {
      const uint8_t* wp = w + k * kPanel;
      __builtin_prefetch(wp + kPrefetch);
      const f16v w0 = widen_fp8(wp), w1 = widen_fp8(wp + 16), w2 = widen_fp8(wp + 32),
                 w3 = widen_fp8(wp + 48);
      fma_rows<MR>(acc, x, k, w0, w1, w2, w3);
    }
    for (int v = 0; v < 4; ++v) {
      const f16v s = load(scale + b * kPanel + v * kLanes);
      for (int r = 0; r < MR; ++r) {
        float* total = sums + r * kPanel + v * kLanes;
        store(total, load(total) + acc[r][v] * s);
      }
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512VBMI__)
constexpr bool kFp8Dot = true;

// The 128 e4m3 magnitudes (code c: exponent c >> 3, mantissa c & 7; 127 is NaN) as float32
inline const float* fp8_magnitudes() {
  static const std::array<float, 128> table = [] {
    std::array<float, 128> t{};
    for (int c = 0; c < 128; ++c) {
      const int e = c >> 3, m = c & 7;
      t[c] = c == 127 ? NAN : e == 0 ? std::ldexp(static_cast<float>(m), -9)
                                     : std::ldexp(1.f + m / 8.f, e - 7);
    }
    return t;
  }();
  return table.data();
}

// bf16(magnitude(c) * scale) for the 128 codes, as vpermi2b tables: low bytes (lo0: codes
// 0-63, lo1: 64-127) and high bytes
struct Fp8Table {
  __m512i lo0, lo1, hi0, hi1;
};

inline Fp8Table fp8_table(float scale) {
  const float* mag = fp8_magnitudes();
  const __m512 s = _mm512_set1_ps(scale);
  __m512i words[4];  // codes 32i..32i + 31 as bf16 (round to nearest even)
  for (int i = 0; i < 4; ++i)
    words[i] = reinterpret_cast<__m512i>(
        _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(mag + 32 * i + 16), s),
                            _mm512_mul_ps(_mm512_loadu_ps(mag + 32 * i), s)));
  static const struct Bytes {  // the low (even) and high (odd) bytes of 64 words
    alignas(64) uint8_t even[64], odd[64];
    Bytes() {
      for (int i = 0; i < 64; ++i) {
        even[i] = static_cast<uint8_t>(2 * i);
        odd[i] = static_cast<uint8_t>(2 * i + 1);
      }
    }
  } bytes;
  const __m512i e = _mm512_load_si512(bytes.even), o = _mm512_load_si512(bytes.odd);
  return {_mm512_permutex2var_epi8(words[0], e, words[1]),
          _mm512_permutex2var_epi8(words[2], e, words[3]),
          _mm512_permutex2var_epi8(words[0], o, words[1]),
          _mm512_permutex2var_epi8(words[2], o, words[3])};
}

inline const Fp8Table& fp8_unit_table() {  // the values themselves (exact)
  static const Fp8Table table = fp8_table(1.f);
  return table;
}

// Byte indices laying out bf16 pairs from [row a's 32 bytes | row b's 32] looked up into `lo`
// (selector bit 6 clear) and `hi` (set): output q's dword d is channel 16q + d's
// (a low, a high, b low, b high)
struct Fp8PairOrder {
  alignas(64) uint8_t idx[2][64];
  Fp8PairOrder() {
    for (int q = 0; q < 2; ++q)
      for (int d = 0; d < 16; ++d) {
        const int c = 16 * q + d;
        idx[q][4 * d] = static_cast<uint8_t>(c);
        idx[q][4 * d + 1] = static_cast<uint8_t>(64 + c);
        idx[q][4 * d + 2] = static_cast<uint8_t>(32 + c);
        idx[q][4 * d + 3] = static_cast<uint8_t>(96 + c);
      }
  }
};

inline __m512i fp8_pair_order(int q) {
  static const Fp8PairOrder order;
  return _mm512_load_si512(order.idx[q]);
}

// Channels 32h..32h + 31's bf16 pairs (inputs 2kp and 2kp + 1) from the two panel rows `a`
// and `b` (each at its half's first byte): out0 channels 32h..32h + 15, out1 the rest
inline void fp8_half_pairs(const uint8_t* a, const uint8_t* b, const Fp8Table& t,
                           __m512i order0, __m512i order1, __m512i& out0, __m512i& out1) {
  const __m512i z = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, z, t.lo1);
  // hi ^ (z & 0x80): the sign (0x78 is A ^ (B & C) for A = hi, B = z, C = 0x80)
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, z, t.hi1), z,
                                               _mm512_set1_epi8(static_cast<char>(0x80)), 0x78);
  out0 = _mm512_permutex2var_epi8(lo, order0, hi);
  out1 = _mm512_permutex2var_epi8(lo, order1, hi);
}

// MR bf16 rows against an fp8 panel: per block of 128 inputs, the rows' pairs meet the exact
// values on vdpbf16ps; the block's sums then take its scale per channel (float32) into `sums`.
// Half a panel (32 channels) at a time, so that 6 rows' 24 sums fit the registers beside the
// tables.
template <int MR>
void panel_fp8_dot(const uint16_t* const* x, const uint8_t* w, const float* scale,
                   int64_t k_total, float* sums) {
  const Fp8Table t = fp8_unit_table();
  const __m512i order0 = fp8_pair_order(0), order1 = fp8_pair_order(1);
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v)
      _mm512_storeu_ps(sums + r * kPanel + v * kLanes, _mm512_setzero_ps());
  for (int64_t b = 0; b * kFp8Block < k_total; ++b) {
    __m512 part[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int v = 0; v < 4; ++v) part[r][v] = _mm512_setzero_ps();
    const int64_t end = std::min(k_total, (b + 1) * kFp8Block);
    for (int64_t kp = b * kFp8Block / 2; kp < end / 2; ++kp) {
      const uint8_t* wa = w + 2 * kp * kPanel;
      __builtin_prefetch(wa + kPrefetch);
      __builtin_prefetch(wa + kPrefetch + 64);
      __m512i xp[MR];
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        std::memcpy(&pair, x[r] + 2 * kp, sizeof pair);
        xp[r] = _mm512_set1_epi32(pair);
      }
      for (int h = 0; h < 2; ++h) {
        __m512i w0, w1;
        fp8_half_pairs(wa + 32 * h, wa + kPanel + 32 * h, t, order0, order1, w0, w1);
        for (int r = 0; r < MR; ++r) {
          part[r][2 * h] = _mm512_dpbf16_ps(part[r][2 * h], reinterpret_cast<__m512bh>(w0),
                                            reinterpret_cast<__m512bh>(xp[r]));
          part[r][2 * h + 1] = _mm512_dpbf16_ps(
              part[r][2 * h + 1], reinterpret_cast<__m512bh>(w1),
              reinterpret_cast<__m512bh>(xp[r]));
        }
      }
    }
    for (int v = 0; v < 4; ++v) {
      const __m512 s = _mm512_loadu_ps(scale + b * kPanel + v * kLanes);
      for (int r = 0; r < MR; ++r) {
        float* total = sums + r * kPanel + v * kLanes;
        _mm512_storeu_ps(total, _mm512_fmadd_ps(part[r][v], s, _mm512_loadu_ps(total)));
      }
    }
  }
}

constexpr int kFp8DotRows = 6;  // rows per register block of panel_fp8_dot

inline void panel_fp8_dot_rows(const uint16_t* const* x, int m, const uint8_t* w,
                               const float* scale, int64_t k_total, float* sums) {
  switch (m) {
    case 1: return panel_fp8_dot<1>(x, w, scale, k_total, sums);
    case 2: return panel_fp8_dot<2>(x, w, scale, k_total, sums);
    case 3: return panel_fp8_dot<3>(x, w, scale, k_total, sums);
    case 4: return panel_fp8_dot<4>(x, w, scale, k_total, sums);
    case 5: return panel_fp8_dot<5>(x, w, scale, k_total, sums);
    default: return panel_fp8_dot<6>(x, w, scale, k_total, sums);
  }
}

// Whether each half panel (32 channels) shares one scale in every block: the scaled tables
// then dequantize it (panel_fp8_dequant_dot, dequantize_fp8_bf16)
inline bool fp8_half_shares_scale(const float* s) {  // s: the half's 32 scales in a block
  const __m512 first = _mm512_set1_ps(s[0]);
  return (_mm512_cmpeq_ps_mask(_mm512_loadu_ps(s), first) &
          _mm512_cmpeq_ps_mask(_mm512_loadu_ps(s + 16), first)) == 0xFFFF;
}

inline bool fp8_halves_share_scales(const float* scale, int64_t k_total) {
  for (int64_t b = 0; b * kFp8Block < k_total; ++b)
    for (int h = 0; h < 2; ++h)
      if (!fp8_half_shares_scale(scale + b * kPanel + 32 * h)) return false;
  return true;
}

// The first MR rows of many against an fp8 panel whose halves share their scales, while the
// panel is dequantized into `dst` (panel.h's bf16 layout; w = bf16(value * scale), as
// dequantize_fp8_bf16 makes it) for the other rows: the lookups overlap this pass's dot
// products (other execution ports) instead of running before them (6% of 48 rows' time).
template <int MR>
void panel_fp8_dequant_dot(const uint16_t* const* x, const uint8_t* q, const float* scale,
                           int64_t k_total, uint16_t* dst, float* sums) {
  const __m512i order0 = fp8_pair_order(0), order1 = fp8_pair_order(1);
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b * kFp8Block < k_total; ++b) {
    const Fp8Table t0 = fp8_table(scale[b * kPanel]), t1 = fp8_table(scale[b * kPanel + 32]);
    const int64_t end = std::min(k_total, (b + 1) * kFp8Block);
    for (int64_t kp = b * kFp8Block / 2; kp < end / 2; ++kp) {
      const uint8_t* wa = q + 2 * kp * kPanel;
      __builtin_prefetch(wa + kPrefetch);
      __builtin_prefetch(wa + kPrefetch + 64);
      __m512i w[4];
      fp8_half_pairs(wa, wa + kPanel, t0, order0, order1, w[0], w[1]);
      fp8_half_pairs(wa + 32, wa + kPanel + 32, t1, order0, order1, w[2], w[3]);
      for (int v = 0; v < 4; ++v) _mm512_storeu_si512(dst + kp * 2 * kPanel + v * 2 * kLanes, w[v]);
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        std::memcpy(&pair, x[r] + 2 * kp, sizeof pair);
        const __m512bh xp = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
        for (int v = 0; v < 4; ++v)
          acc[r][v] = _mm512_dpbf16_ps(acc[r][v], reinterpret_cast<__m512bh>(w[v]), xp);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(sums + r * kPanel + v * kLanes, acc[r][v]);
}

inline void panel_fp8_dequant_rows(const uint16_t* const* x, int m, const uint8_t* q,
                                   const float* scale, int64_t k_total, uint16_t* dst,
                                   float* sums) {
  switch (m) {
    case 1: return panel_fp8_dequant_dot<1>(x, q, scale, k_total, dst, sums);
    case 2: return panel_fp8_dequant_dot<2>(x, q, scale, k_total, dst, sums);
    case 3: return panel_fp8_dequant_dot<3>(x, q, scale, k_total, dst, sums);
    case 4: return panel_fp8_dequant_dot<4>(x, q, scale, k_total, dst, sums);
    case 5: return panel_fp8_dequant_dot<5>(x, q, scale, k_total, dst, sums);
    default: return panel_fp8_dequant_dot<6>(x, q, scale, k_total, dst, sums);
  }
}

// An fp8 panel (q: its bytes, scale: its (blocks, 64) scales) as a plain bf16 panel (panel.h's
// (K/2, 64, 2) layout): w = bf16(value * scale)
inline void dequantize_fp8_bf16(const uint8_t* q, const float* scale, int64_t k_total,
                                uint16_t* dst) {
  const __m512i order0 = fp8_pair_order(0), order1 = fp8_pair_order(1);
  for (int64_t b = 0; b * kFp8Block < k_total; ++b) {
    const float* s = scale + b * kPanel;
    const int64_t end = std::min(k_total, (b + 1) * kFp8Block);
    for (int h = 0; h < 2; ++h) {
      if (fp8_half_shares_scale(s + 32 * h)) {
        const Fp8Table t = fp8_table(s[32 * h]);
        for (int64_t kp = b * kFp8Block / 2; kp < end / 2; ++kp) {
          const uint8_t* wa = q + 2 * kp * kPanel + 32 * h;
          __m512i o0, o1;
          fp8_half_pairs(wa, wa + kPanel, t, order0, order1, o0, o1);
          _mm512_storeu_si512(dst + kp * 2 * kPanel + 64 * h, o0);
          _mm512_storeu_si512(dst + kp * 2 * kPanel + 64 * h + 32, o1);
        }
        continue;
      }
      for (int64_t kp = b * kFp8Block / 2; kp < end / 2; ++kp)
        for (int v = 2 * h; v < 2 * h + 2; ++v) {
          const __m512 sv = _mm512_loadu_ps(s + v * kLanes);
          const f16v low = widen_fp8(q + 2 * kp * kPanel + v * kLanes),
                     high = widen_fp8(q + (2 * kp + 1) * kPanel + v * kLanes);
          __m512 lo, hi;
          std::memcpy(&lo, &low, sizeof lo);
          std::memcpy(&hi, &high, sizeof hi);
          store_bf16_pairs(dst + kp * 2 * kPanel + v * 2 * kLanes, _mm512_mul_ps(lo, sv),
                           _mm512_mul_ps(hi, sv));
        }
    }
  }
}
#else
constexpr bool kFp8Dot = false;
#endif

}  // namespace evenflow_panel
