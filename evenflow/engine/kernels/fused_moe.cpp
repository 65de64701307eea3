// The routed experts of a MoE layer in one call: tokens grouped by expert, every expert's
// gate_up matmul with SiLU(gate) * up fused into its epilogue, every expert's down matmul
// with the routing weight fused into its epilogue, and each token's k expert outputs summed.
//
// Why: the torch path runs per expert an index, two matmuls, a chunk, a silu, a mul, a copy,
// then a weighted index_add over all pairs: ~10 ops an expert, ~80 a layer at decode, each a
// dispatch and an allocation, where the step is bound by reading the expert weights. Here the
// weights are read once, from a layout made for it, and nothing else is allocated per expert.
//
// Weight layout (packed once at load by evenflow/engine/fused_moe.py): a weight (N, K) is cut
// into panels of 64 output channels; within a panel the inputs run outermost, so a panel is
// one contiguous stream and a vector load gives 16 channels at once (no horizontal sums):
//   bf16: (N/64, K/2, 64, 2) — pairs of inputs side by side, for AVX512-BF16's vdpbf16ps;
//   f32:  (N/64, K, 64).
// The gate_up weight's channels are interleaved first: panel p holds gate channels
// [32p, 32p + 32) and then up channels [32p, 32p + 32), so one panel yields 32 activations.
//
// Threads: ATen's pool. Tasks are (panel, expert) pairs, panel-major, so the static split of
// at::parallel_for hands every thread the same share of each expert (balanced at prefill too).
// Compiled at first use with -march=native by evenflow/engine/native.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

typedef float f16v __attribute__((vector_size(64)));      // 16 x float32
typedef int32_t i16v __attribute__((vector_size(64)));    // 16 x int32
typedef uint32_t u16v __attribute__((vector_size(64)));   // 16 x uint32
constexpr int kLanes = 16;
constexpr int kPanel = 64;  // output channels per panel: 4 vectors
#if defined(__AVX512F__)
constexpr int kRows = 6;  // rows per register block: 24 accumulators of 32 registers
#else
constexpr int kRows = 2;  // AVX2: a 16-float vector is two registers of 16
#endif

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

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline void store_row(float* dst, const float* src, int n) { std::memcpy(dst, src, n * 4); }

inline void store_row(uint16_t* dst, const float* src, int n) {
  for (int i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}

// sums[r][c] = sum over k of x[r][k] * w[c][k] for one panel (64 channels) and MR rows.
template <int MR>
void panel_f32(const float* const* x, const float* w, int64_t k_total, float* sums) {
  f16v acc[MR][4] = {};
  for (int64_t k = 0; k < k_total; ++k) {
    const float* wp = w + k * kPanel;
    const f16v w0 = load(wp), w1 = load(wp + 16), w2 = load(wp + 32), w3 = load(wp + 48);
    for (int r = 0; r < MR; ++r) {
      const f16v xv = splat(x[r][k]);
      acc[r][0] += xv * w0;
      acc[r][1] += xv * w1;
      acc[r][2] += xv * w2;
      acc[r][3] += xv * w3;
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) store(sums + r * kPanel + v * kLanes, acc[r][v]);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
template <int MR>
void panel_bf16(const uint16_t* const* x, const uint16_t* w, int64_t k_total, float* sums) {
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < k_total / 2; ++kp) {
    const uint16_t* wp = w + kp * 2 * kPanel;
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

// One panel for m <= kRows rows: the register-blocked kernel of that row count.
template <typename T>
void panel(const T* const* x, int m, const T* w, int64_t k_total, float* sums) {
  if constexpr (std::is_same_v<T, float>) {
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

template <typename T>
at::Tensor fused_moe_impl(const at::Tensor& x, const at::Tensor& ids,
                          const at::Tensor& route_weights, const std::vector<at::Tensor>& w13,
                          const std::vector<at::Tensor>& w2) {
  const int64_t tokens = x.size(0), hidden = x.size(1), top_k = ids.size(1);
  const int64_t experts = static_cast<int64_t>(w13.size());
  const int64_t inter = w2[0].numel() / hidden;
  const int64_t pairs = tokens * top_k;
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* route = route_weights.data_ptr<float>();

  // pairs grouped by expert (stable): order[s] is the pair at sorted position s
  std::vector<int64_t> start(experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < experts, "expert id ", id[p], " out of range");
    ++start[id[p] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> order(pairs), position(pairs), fill(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) {
    position[p] = fill[id[p]]++;
    order[position[p]] = p;
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < experts; ++e)
    if (start[e + 1] > start[e]) active.push_back(e);
  const int64_t n_active = static_cast<int64_t>(active.size());

  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  std::vector<T> act(static_cast<size_t>(pairs * inter));
  std::vector<float> ys(static_cast<size_t>(pairs * hidden));

  // gate_up, then silu(gate) * up: tasks (panel, expert), panel-major
  const int64_t panels13 = inter / (kPanel / 2);
  at::parallel_for(0, panels13 * n_active, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kRows * kPanel];
    alignas(64) float out[kRows * kPanel / 2];
    const T* rows[kRows];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = t / n_active, e = active[t % n_active];
      const T* w = reinterpret_cast<const T*>(w13[e].data_ptr()) + p * kPanel * hidden;
      for (int64_t s0 = start[e]; s0 < start[e + 1]; s0 += kRows) {
        const int m = static_cast<int>(std::min<int64_t>(kRows, start[e + 1] - s0));
        for (int r = 0; r < m; ++r) rows[r] = xp + (order[s0 + r] / top_k) * hidden;
        panel(rows, m, w, hidden, sums);
        for (int r = 0; r < m; ++r) {
          for (int v = 0; v < 2; ++v) {
            const float* g = sums + r * kPanel + v * kLanes;
            store(out + r * kPanel / 2 + v * kLanes, silu_mul(load(g), load(g + kPanel / 2)));
          }
          store_row(act.data() + (s0 + r) * inter + p * kPanel / 2, out + r * kPanel / 2,
                    kPanel / 2);
        }
      }
    }
  });

  // down, times each pair's routing weight: tasks (panel, expert), panel-major
  const int64_t panels2 = hidden / kPanel;
  at::parallel_for(0, panels2 * n_active, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kRows * kPanel];
    const T* rows[kRows];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = t / n_active, e = active[t % n_active];
      const T* w = reinterpret_cast<const T*>(w2[e].data_ptr()) + p * kPanel * inter;
      for (int64_t s0 = start[e]; s0 < start[e + 1]; s0 += kRows) {
        const int m = static_cast<int>(std::min<int64_t>(kRows, start[e + 1] - s0));
        for (int r = 0; r < m; ++r) rows[r] = act.data() + (s0 + r) * inter;
        panel(rows, m, w, inter, sums);
        for (int r = 0; r < m; ++r) {
          const f16v scale = splat(route[order[s0 + r]]);
          float* y = ys.data() + (s0 + r) * hidden + p * kPanel;
          for (int v = 0; v < 4; ++v)
            store(y + v * kLanes, load(sums + r * kPanel + v * kLanes) * scale);
        }
      }
    }
  });

  // each token's k expert outputs summed in float (in routing order), rounded once
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> total(static_cast<size_t>(hidden));
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(total.data(), ys.data() + position[t * top_k] * hidden, hidden * 4);
      for (int64_t j = 1; j < top_k; ++j) {
        const float* y = ys.data() + position[t * top_k + j] * hidden;
        for (int64_t h = 0; h < hidden; h += kLanes)
          store(total.data() + h, load(total.data() + h) + load(y + h));
      }
      store_row(op + t * hidden, total.data(), static_cast<int>(hidden));
    }
  });
  return out;
}

// x (T, H) float32 or bfloat16; ids (T, k) int64 slot ids; route_weights (T, k) float32;
// w13[e] / w2[e]: slot e's gate_up and down weights in the packed layout above, x's dtype.
at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& route_weights,
                     at::TensorList w13, at::TensorList w2) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous (T, H) matrix");
  TORCH_CHECK(ids.dim() == 2 && ids.is_contiguous() && ids.scalar_type() == at::kLong &&
                  ids.size(0) == x.size(0),
              "ids must be a contiguous (T, k) int64 matrix");
  TORCH_CHECK(route_weights.sizes() == ids.sizes() && route_weights.is_contiguous() &&
                  route_weights.scalar_type() == at::kFloat,
              "route_weights must be a contiguous float32 matrix shaped like ids");
  TORCH_CHECK(!w13.empty() && w13.size() == w2.size(), "one gate_up and one down per slot");
  const int64_t hidden = x.size(1);
  const int64_t inter = w2[0].numel() / hidden;
  TORCH_CHECK(hidden % kPanel == 0 && inter % kPanel == 0,
              "hidden and intermediate sizes must be multiples of 64");
  for (size_t e = 0; e < w13.size(); ++e) {
    TORCH_CHECK(w13[e].is_contiguous() && w2[e].is_contiguous() &&
                    w13[e].scalar_type() == x.scalar_type() &&
                    w2[e].scalar_type() == x.scalar_type() &&
                    w13[e].numel() == 2 * inter * hidden && w2[e].numel() == hidden * inter,
                "slot ", e, ": packed weights of the wrong size, dtype or layout");
  }
  std::vector<at::Tensor> gate_up(w13.begin(), w13.end()), down(w2.begin(), w2.end());
  if (x.scalar_type() == at::kFloat)
    return fused_moe_impl<float>(x, ids, route_weights, gate_up, down);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(kHasBf16Dot, "bfloat16 fused MoE needs AVX512-BF16");
  return fused_moe_impl<uint16_t>(x, ids, route_weights, gate_up, down);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(evenflow_kernels, m) {
  m.def("fused_moe(Tensor x, Tensor ids, Tensor route_weights, Tensor[] w13, Tensor[] w2) -> "
        "Tensor");
  m.def("fused_moe_bf16_supported", []() { return kHasBf16Dot; });
}

TORCH_LIBRARY_IMPL(evenflow_kernels, CPU, m) { m.impl("fused_moe", &fused_moe); }
