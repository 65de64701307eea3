// MLA decode's bf16 paths (kernels/mla_decode.cpp): AVX512-BF16 pairs and AMX tiles for the
// attention pass, AMX tiles for the W_uk / W_uv passes from batch 4, and the layouts they need
// (token pairs, query pairs). Included by mla_decode.cpp only, which holds the float32 paths,
// the passes' order and the entry points.

#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cache_rows.h"
#include "panel.h"
#include "panel_amx.h"

namespace evenflow_mla {

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

struct Shape {
  int64_t batch, heads, nope, rope, rank, v_dim, width;  // width: slots per sequence
  int64_t q_nope_stride[2], q_pe_stride[2];               // (b, h) strides, in elements
  int64_t latent() const { return rank + rope; }          // a cache row
};

// the most heads a pass-2 task takes (its stack arrays)
constexpr int64_t kMaxGroup = 64;

// heads and tokens (scores) or heads and vectors (values) per register block: 16 accumulators,
// each latent and query vector loaded once per block
constexpr int kBlock = 4;
// the fewest heads a task takes AMX tiles for
constexpr int64_t kAmxMinHeads = 8;

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
  const __m512i interleave = evenflow_panel::interleave_halves();
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

}  // namespace evenflow_mla
