// Shared pieces of the panel kernels (fused_moe.cpp, panel_linear.cpp; its float helpers also
// serve paged_attention.cpp and weight_only.cpp): the register-blocked
// matmul over one panel of 64 output channels in the packed layout, and float helpers.
//
// Packed layout (made by evenflow/engine/kernels/panels.py): a weight (N, K) is cut into panels of
// 64 output channels; within a panel the inputs run outermost, so a panel is one contiguous
// stream and one vector load gives 16 channels (no horizontal sums):
//   bf16: (N/64, K/2, 64, 2) — pairs of inputs side by side, for AVX512-BF16's vdpbf16ps;
//   f32:  (N/64, K, 64).

#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace evenflow_panel {

typedef float f16v __attribute__((vector_size(64)));      // 16 x float32
typedef int32_t i16v __attribute__((vector_size(64)));    // 16 x int32
typedef uint32_t u16v __attribute__((vector_size(64)));   // 16 x uint32
typedef uint16_t u16x16 __attribute__((vector_size(32)));  // 16 x bf16 bits
constexpr int kLanes = 16;
constexpr int kPanel = 64;  // output channels per panel: 4 vectors
#if defined(__AVX512F__)
constexpr int kRows = 6;  // rows per register block: 24 accumulators of 32 registers
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kRows = 12;  // AVX2, float32: 12 rows a pass through the panel (panel_f32_avx2)
#else
constexpr int kRows = 2;
#endif

// Built for AVX-512: the panel kernels' 64-channel register blocks fit its 32 registers. On
// AVX2 (16 registers) the 16-float vectors spill and measured ~20x slower than oneDNN, so the
// bf16 and quantized panels stay AVX-512's (engine/kernels/panels.py asks `panel_kernels_fast`).
#if defined(__AVX512F__)
constexpr bool kPanelsFast = true;
#else
constexpr bool kPanelsFast = false;
#endif
// float32 panels have their own AVX2 kernel (panel_f32_avx2: 8-float registers, half a panel at
// a time, no spills): the engine packs float32 weights for them on AVX2 builds too.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
constexpr bool kPanelsF32Fast = true;
#else
constexpr bool kPanelsF32Fast = false;
#endif
// AVX2 builds, float32: from this many rows a weight (or an expert's rows) goes to ATen's
// matmul over the panels instead — each panel (K, 64) is a plain row-major matrix, so
// x @ panel is one batched GEMM. The AVX2 panel kernel ran 1.2-4.6x oneDNN at 1-32 rows but
// 0.7-0.9x from 128 (prefill), where oneDNN's blocking wins.
#if defined(__AVX512F__)
constexpr int64_t kBlasRows = INT64_MAX;
#else
constexpr int64_t kBlasRows = 64;
#endif

// x (M, K) float32 @ a plain float32 panel-packed weight (P, K, 64) -> (M, P * 64)
inline at::Tensor matmul_over_panels(const at::Tensor& x, const at::Tensor& packed) {
  const int64_t panels = packed.numel() / (x.size(1) * kPanel);
  return at::matmul(x, packed.view({panels, x.size(1), kPanel}))
      .permute({1, 0, 2})
      .reshape({x.size(0), panels * kPanel});
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kHasBf16Dot = true;
#else
constexpr bool kHasBf16Dot = false;
#endif

inline f16v load(const float* p) {
  f16v v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, f16v v) { std::memcpy(p, &v, sizeof v); }

inline f16v splat(float x) { return f16v{} + x; }

// e^x for x <= 0, 16 lanes (Cephes' expf polynomial; relative error ~2e-7)
inline f16v exp_nonpositive(f16v x) {
  x = x < -87.f ? splat(-87.f) : x;
  const i16v n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, i16v);  // round
  const f16v nf = __builtin_convertvector(n, f16v);
  f16v r = x - nf * 0.693359375f;
  r = r + nf * 2.12194440e-4f;
  f16v p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const u16v scale = __builtin_convertvector(n + 127, u16v) << 23;
  f16v two_n;
  std::memcpy(&two_n, &scale, sizeof two_n);
  return p * two_n;
}

// silu(g) * u = g * sigmoid(g) * u, with sigmoid from e^-|g| (no overflow either way)
inline f16v silu_mul(f16v g, f16v u) {
  const f16v e = exp_nonpositive(g < 0.f ? g : -g);
  const f16v sigmoid = g < 0.f ? e / (1.f + e) : 1.f / (1.f + e);
  return g * sigmoid * u;
}

// 16 values of float32 / bf16 as float32, and back (bf16: round to nearest even, NaN kept
// quiet — as c10::BFloat16 rounds); the norm, rotary and attention kernels' loads and stores.
inline f16v load16(const float* p) { return load(p); }
inline f16v load16(const c10::BFloat16* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  const u16v bits = __builtin_convertvector(h, u16v) << 16;  // (one vpmovzxwd, one shift)
  f16v f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline f16v bf16_round(f16v v) {  // to the nearest bf16, kept as float32
  u16v u;
  std::memcpy(&u, &v, sizeof u);
  const u16v even = ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) << 16;
  const u16v nan = ((u >> 16) | 0x40u) << 16;
  const u16v out = (u & 0x7fffffffu) > 0x7f800000u ? nan : even;
  f16v f;
  std::memcpy(&f, &out, sizeof f);
  return f;
}
inline void store16(float* p, f16v v) { store(p, v); }
inline void store16(c10::BFloat16* p, f16v v) {
  const f16v r = bf16_round(v);
  u16v u;
  std::memcpy(&u, &r, sizeof u);
  uint16_t bits[kLanes];
  for (int i = 0; i < kLanes; ++i) bits[i] = static_cast<uint16_t>(u[i] >> 16);  // (vpmovdw)
  std::memcpy(p, bits, sizeof bits);
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline void store_row(float* dst, const float* src, int n) { std::memcpy(dst, src, n * 4); }

inline void store_row(uint16_t* dst, const float* src, int n) {
  int i = 0;
#if defined(__AVX512F__)
  for (; i + kLanes <= n; i += kLanes) {  // 16 at a time: rounded as float_to_bf16, one vpmovdw
    const f16v r = bf16_round(load(src + i));
    __m512i bits;
    std::memcpy(&bits, &r, sizeof bits);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
  }
#endif
  for (; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}

// acc[r] += x[r][k] * (w0 | w1 | w2 | w3): input k of MR float rows against 64 channels' weights
template <int MR>
inline void fma_rows(f16v (&acc)[MR][4], const float* const* x, int64_t k, f16v w0, f16v w1,
                     f16v w2, f16v w3) {
  for (int r = 0; r < MR; ++r) {
    const f16v xv = splat(x[r][k]);
    acc[r][0] += xv * w0;
    acc[r][1] += xv * w1;
    acc[r][2] += xv * w2;
    acc[r][3] += xv * w3;
  }
}

// sums[r][c] = sum over k of x[r][k] * w[c][k] for one panel (64 channels) and MR rows.
template <int MR>
void panel_f32(const float* const* x, const float* w, int64_t k_total, float* sums) {
  f16v acc[MR][4] = {};
  for (int64_t k = 0; k < k_total; ++k) {
    const float* wp = w + k * kPanel;
    const f16v w0 = load(wp), w1 = load(wp + 16), w2 = load(wp + 32), w3 = load(wp + 48);
    fma_rows<MR>(acc, x, k, w0, w1, w2, w3);
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) store(sums + r * kPanel + v * kLanes, acc[r][v]);
}

// Few-row panels are bound by reading the weights, and one core keeps too few misses in
// flight for its share of the bandwidth: software prefetch kPrefetchPairs input pairs
// (kPrefetchPairs * 256 bytes) ahead.
constexpr int kPrefetchRows = 3;
constexpr int64_t kPrefetchPairs = 16;
constexpr int kPrefetch = 1024;  // bytes ahead in a quantized panel's weight stream

#if defined(__AVX512F__)
// 16-bit lane order taking [a0..a15, b0..b15] to [a0, b0, a1, b1, ...]
inline __m512i interleave_halves() {
  return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                          22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// 16 channels' values at inputs 2kp (low) and 2kp + 1 (high) as bf16 pairs at dst, the plain
// bf16 panel's layout (channel c's pair side by side, 2kp first)
inline void store_bf16_pairs(uint16_t* dst, __m512 low, __m512 high) {
  const __m512i halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(interleave_halves(), halves));
}

template <int MR>
void panel_bf16(const uint16_t* const* x, const uint16_t* w, int64_t k_total, float* sums) {
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < k_total / 2; ++kp) {
    const uint16_t* wp = w + kp * 2 * kPanel;
    if constexpr (MR <= kPrefetchRows) {  // few rows: bound by reading the panel
      const char* ahead = reinterpret_cast<const char*>(wp + kPrefetchPairs * 2 * kPanel);
      for (int line = 0; line < 4; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    }
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(wp));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(wp + 32));
    const __m512bh w2 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(wp + 64));
    const __m512bh w3 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(wp + 96));
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, x[r] + 2 * kp, sizeof pair);
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xv, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xv, w3);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(sums + r * kPanel + v * kLanes, acc[r][v]);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2 has 16 registers of 8 floats: the 16-float vectors above would spill. One row takes the
// whole panel at once (8 accumulators, 8 chains in flight). More rows go through the panel in
// chunks of kAvx2Chunk inputs (16 KB of weights, L1-resident): per chunk, each block of 3 rows
// takes each half panel (32 channels) in turn, its 12 sums loaded from and stored back to
// `sums` around the chunk. The weights stream from memory once, in order, for any row count.
constexpr int64_t kAvx2Chunk = 64;

inline void panel_f32_avx2_row(const float* x, const float* w, int64_t k_total, float* sums) {
  __m256 acc[8];
  for (int v = 0; v < 8; ++v) acc[v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_total; ++k) {
    const __m256 xv = _mm256_broadcast_ss(x + k);
    for (int v = 0; v < 8; ++v)
      acc[v] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + k * kPanel + 8 * v), acc[v]);
  }
  for (int v = 0; v < 8; ++v) _mm256_storeu_ps(sums + 8 * v, acc[v]);
}

// (Prefetch: the first pass over a chunk also asks for the next chunk's rows, all four lines of
// each: the passes over half panels touch half of each row, which a stride prefetcher follows)
template <int MR, bool Prefetch>
inline void panel_f32_avx2_chunk(const float* const* x, const float* w, int64_t k0, int64_t k1,
                                 float* sums, int c0) {
  __m256 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_loadu_ps(sums + r * kPanel + c0 + 8 * v);
  for (int64_t k = k0; k < k1; ++k) {
    const float* wp = w + k * kPanel + c0;
    if constexpr (Prefetch) {
      const char* next = reinterpret_cast<const char*>(w + (k + kAvx2Chunk) * kPanel);
      for (int line = 0; line < 4; ++line) _mm_prefetch(next + 64 * line, _MM_HINT_T0);
    }
    __m256 xv[MR];
    for (int r = 0; r < MR; ++r) xv[r] = _mm256_broadcast_ss(x[r] + k);
    for (int v = 0; v < 4; ++v) {
      const __m256 wv = _mm256_loadu_ps(wp + 8 * v);
      for (int r = 0; r < MR; ++r) acc[r][v] = _mm256_fmadd_ps(xv[r], wv, acc[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(sums + r * kPanel + c0 + 8 * v, acc[r][v]);
}

inline void panel_f32_avx2(const float* const* x, int m, const float* w, int64_t k_total,
                           float* sums) {
  if (m == 1) return panel_f32_avx2_row(x[0], w, k_total, sums);
  std::memset(sums, 0, sizeof(float) * m * kPanel);
  for (int64_t k0 = 0; k0 < k_total; k0 += kAvx2Chunk) {
    const int64_t k1 = std::min(k0 + kAvx2Chunk, k_total);
    for (int r0 = 0; r0 < m; r0 += 3) {
      for (int c0 = 0; c0 < kPanel; c0 += 32) {
        float* s = sums + r0 * kPanel;
        const bool first = r0 == 0 && c0 == 0 && k1 + kAvx2Chunk <= k_total;
        switch (std::min(3, m - r0) + (first ? 3 : 0)) {
          case 1: panel_f32_avx2_chunk<1, false>(x + r0, w, k0, k1, s, c0); break;
          case 2: panel_f32_avx2_chunk<2, false>(x + r0, w, k0, k1, s, c0); break;
          case 3: panel_f32_avx2_chunk<3, false>(x + r0, w, k0, k1, s, c0); break;
          case 4: panel_f32_avx2_chunk<1, true>(x + r0, w, k0, k1, s, c0); break;
          case 5: panel_f32_avx2_chunk<2, true>(x + r0, w, k0, k1, s, c0); break;
          default: panel_f32_avx2_chunk<3, true>(x + r0, w, k0, k1, s, c0); break;
        }
      }
    }
  }
}
#endif

// One panel for m <= kRows rows: the register-blocked kernel of that row count.
template <typename T>
void panel(const T* const* x, int m, const T* w, int64_t k_total, float* sums) {
  if constexpr (std::is_same_v<T, float>) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    return panel_f32_avx2(x, m, w, k_total, sums);
#endif
    switch (m) {
      case 1: return panel_f32<1>(x, w, k_total, sums);
#if defined(__AVX512F__)
      case 2: return panel_f32<2>(x, w, k_total, sums);
      case 3: return panel_f32<3>(x, w, k_total, sums);
      case 4: return panel_f32<4>(x, w, k_total, sums);
      case 5: return panel_f32<5>(x, w, k_total, sums);
      default: return panel_f32<6>(x, w, k_total, sums);
#else
      default: return panel_f32<2>(x, w, k_total, sums);
#endif
    }
  } else {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    switch (m) {
      case 1: return panel_bf16<1>(x, w, k_total, sums);
      case 2: return panel_bf16<2>(x, w, k_total, sums);
      case 3: return panel_bf16<3>(x, w, k_total, sums);
      case 4: return panel_bf16<4>(x, w, k_total, sums);
      case 5: return panel_bf16<5>(x, w, k_total, sums);
      default: return panel_bf16<6>(x, w, k_total, sums);
    }
#else
    TORCH_CHECK(false, "bf16 fused MoE needs AVX512-BF16");
#endif
  }
}

}  // namespace evenflow_panel
