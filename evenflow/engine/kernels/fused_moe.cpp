// The routed experts of a MoE layer in one call: tokens grouped by expert, every expert's
// gate_up matmul with its bias and activation fused into its epilogue (SiLU(gate) * up, or
// GPT-OSS's clamped SwiGLU), every expert's down matmul with its bias and the routing weight
// fused into its epilogue, and each token's k expert outputs summed.
//
// Why: the torch path runs per expert an index, two matmuls, a chunk, a silu, a mul, a copy,
// then a weighted index_add over all pairs: ~10 ops an expert, ~80 a layer at decode, each a
// dispatch and an allocation, where the step is bound by reading the expert weights. Here the
// weights are read once, from a layout made for it, and nothing else is allocated per expert.
//
// Weight layout (packed once at load by evenflow/engine/kernels/panels.py): a weight (N, K) is cut
// into panels of 64 output channels; within a panel the inputs run outermost, so a panel is
// one contiguous stream and a vector load gives 16 channels at once (no horizontal sums):
//   bf16: (N/64, K/2, 64, 2) — pairs of inputs side by side, for AVX512-BF16's vdpbf16ps;
//   f32:  (N/64, K, 64).
// The gate_up weight's channels are interleaved first: panel p holds gate channels
// [32p, 32p + 32) and then up channels [32p, 32p + 32), so one panel yields 32 activations.
//
// Threads: ATen's pool. Tasks are (panel, expert) pairs, panel-major, so the static split of
// at::parallel_for hands every thread the same share of each expert (balanced at prefill too).
// Compiled at first use with -march=native by evenflow/engine/kernels/native.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "ops.h"
#include "panel_run.h"

namespace {

using namespace evenflow_panel;

// What the experts' epilogues add to plain SiLU(gate) * up: per-slot biases (b13 (S, 2I) as
// [gate | up], b2 (S, H), float32) and the activation.
enum Activation : int64_t { kSiluMul = 0, kClampedSwiglu = 1 };

struct ExpertEpilogue {
  const float* b13 = nullptr;
  const float* b2 = nullptr;
  int64_t activation = kSiluMul;
  float alpha = 1.f, limit = 0.f;
  bool plain() const { return b13 == nullptr && b2 == nullptr && activation == kSiluMul; }
};

// The next task's panel, requested (into L2) while this task runs: a task's stream is one
// panel (32-64 KB at decode), too short for the hardware prefetcher, which restarts at every
// 4 KB page, to reach full distance before it ends. Measured on the GPT-OSS-shaped bench
// layer (bf16, 2 threads, Sapphire Rapids): 0.32 / 1.19 / 1.62 ms at 1 / 8 / 32 tokens
// without, 0.20 / 0.87 / 1.33 with the whole next panel (8 KB of it: 0.26 / 0.96 / 1.50).
constexpr int64_t kNextPanelBytes = 64 * 1024;  // at most this much of it

inline void prefetch_panel(const Weight& w, int64_t p, int64_t k_total, int64_t elem) {
  int64_t bytes = panel_bytes(w.format, k_total, elem);
  const char* at = static_cast<const char*>(w.data) + p * bytes;
  bytes = std::min(bytes, kNextPanelBytes);
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(at + b, _MM_HINT_T1);
}

inline f16v sigmoid(f16v z) {
  const f16v e = exp_nonpositive(z < 0.f ? z : -z);
  return z < 0.f ? e / (1.f + e) : 1.f / (1.f + e);
}

// GPT-OSS's experts: gate clamped above at limit, up to [-limit, limit], then
// (up + 1) * gate * sigmoid(alpha * gate) (model/moe.py clamped_swiglu)
inline f16v clamped_swiglu(f16v g, f16v u, float alpha, float limit) {
  g = g > limit ? splat(limit) : g;
  u = u > limit ? splat(limit) : u;
  u = u < -limit ? splat(-limit) : u;
  return (u + 1.f) * (g * sigmoid(g * alpha));
}

// One expert's rows [first, first + m) of the grouped pairs through ATen's matmul over its
// panels (AVX2 builds, float32, many rows: kBlasRows): ys rows get down(silu(gate) * up) times
// each pair's routing weight. Panel p of gate_up gives gate and up channels [32p, 32p + 32).
void expert_by_matmul(const at::Tensor& x, const std::vector<int64_t>& order, int64_t first,
                      int64_t m, int64_t top_k, const float* route, const at::Tensor& w13,
                      const at::Tensor& w2, int64_t inter, float* ys) {
  const int64_t hidden = x.size(1);
  at::Tensor rows = at::empty({m}, at::kLong), weights = at::empty({m, 1}, at::kFloat);
  for (int64_t i = 0; i < m; ++i) {
    rows.data_ptr<int64_t>()[i] = order[first + i] / top_k;
    weights.data_ptr<float>()[i] = route[order[first + i]];
  }
  const at::Tensor h = at::matmul(x.index_select(0, rows), w13.view({inter / 32, hidden, 64}));
  const at::Tensor act = (at::silu(h.narrow(2, 0, 32)) * h.narrow(2, 32, 32))
                             .permute({1, 0, 2})
                             .reshape({m, inter});
  at::Tensor y = matmul_over_panels(act, w2).mul_(weights);
  std::memcpy(ys + first * hidden, y.contiguous().data_ptr<float>(), m * hidden * 4);
}

template <typename T>
at::Tensor fused_moe_impl(const at::Tensor& x, const at::Tensor& ids,
                          const at::Tensor& route_weights, const std::vector<Weight>& w13,
                          const std::vector<Weight>& w2, int64_t inter,
                          const ExpertEpilogue& epi, at::TensorList w13_t = {},
                          at::TensorList w2_t = {}) {
  const int64_t tokens = x.size(0), hidden = x.size(1), top_k = ids.size(1);
  const int64_t experts = static_cast<int64_t>(w13.size());
  const int64_t pairs = tokens * top_k;
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* route = route_weights.data_ptr<float>();
  const bool quantized = w13[0].format != Format::kPlain;

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
  // (every row of ys, act and act_f is written before it is read: no zeroing)
  std::unique_ptr<float[]> ys(new float[pairs * hidden]);
  std::vector<int64_t> active;  // experts for the panel loops below
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t m = start[e + 1] - start[e];
    if (m >= kBlasRows && !quantized && std::is_same_v<T, float> && !w13_t.empty() &&
        epi.plain())
      expert_by_matmul(x, order, start[e], m, top_k, route, w13_t[e], w2_t[e], inter, ys.get());
    else if (m > 0)
      active.push_back(e);
  }
  const int64_t n_active = static_cast<int64_t>(active.size());

  // an expert with few rows takes them quantized (W8A8, W4A8): dequant_rows decides, per weight
  auto few_for = [&](const Weight& wt) {
    const int64_t limit = dequant_rows<T>(wt);
    return std::any_of(active.begin(), active.end(),
                       [&](int64_t e) { return start[e + 1] - start[e] < limit; });
  };
  const bool few13 = few_for(w13[0]), few2 = few_for(w2[0]);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  std::vector<float> x_copy;
  const float* xf = few13 && reads_float_rows<T>(w13[0])
                        ? float_rows(xp, tokens * hidden, x_copy)
                        : nullptr;
  QuantRows xq, actq;  // w8a8 / w4a8: the tokens and the activations, quantized
  quantize_rows_for(w13[0], xp, tokens, hidden, few13, xq);
  std::unique_ptr<T[]> act(new T[pairs * inter]);
  // float activations too where a quantized down panel may read them directly
  std::unique_ptr<float[]> act_f(few2 && reads_float_rows<T>(w2[0]) && !std::is_same_v<T, float>
                                     ? new float[pairs * inter]
                                     : nullptr);
  float* actf = std::is_same_v<T, float> ? reinterpret_cast<float*>(act.get()) : act_f.get();

  // gate_up, then silu(gate) * up: tasks (panel, expert), panel-major
  const int64_t panels13 = inter / (kPanel / 2);
  at::parallel_for(0, panels13 * n_active, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float out[std::max(kRows, kAmxRows) * kPanel / 2];  // (a block's rows)
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = t / n_active, e = active[t % n_active];
      const int64_t first = start[e];
      if (t + 1 < end) prefetch_panel(w13[active[(t + 1) % n_active]], (t + 1) / n_active, hidden,
                                    sizeof(T));
      run_panel<T>(
          w13[e], p, hidden, start[e + 1] - first,
          [&](int64_t i) { return xp + (order[first + i] / top_k) * hidden; },
          [&](int64_t i) { return xf + (order[first + i] / top_k) * hidden; },
          [&](int64_t i) { return xq.at(order[first + i] / top_k); },
          [&](int64_t r0, int mm, const float* sums) {
            const float* bias = epi.b13 != nullptr ? epi.b13 + e * 2 * inter : nullptr;
            for (int r = 0; r < mm; ++r) {
              for (int v = 0; v < 2; ++v) {
                const float* s = sums + r * kPanel + v * kLanes;
                f16v g = load(s), u = load(s + kPanel / 2);
                if (bias != nullptr) {  // (plain order: gate channels, then up channels)
                  g += load(bias + p * kPanel / 2 + v * kLanes);
                  u += load(bias + inter + p * kPanel / 2 + v * kLanes);
                }
                store(out + r * kPanel / 2 + v * kLanes,
                      epi.activation == kClampedSwiglu
                          ? clamped_swiglu(g, u, epi.alpha, epi.limit)
                          : silu_mul(g, u));
              }
              const int64_t at = (first + r0 + r) * inter + p * kPanel / 2;
              store_row(act.get() + at, out + r * kPanel / 2, kPanel / 2);
              if (act_f) std::memcpy(act_f.get() + at, out + r * kPanel / 2, 128);
            }
          },
          kAmxMinRowsExperts);
    }
  });

  quantize_rows_for(w2[0], act.get(), pairs, inter, few2, actq);

  // down, times each pair's routing weight: tasks (panel, expert), panel-major
  const int64_t panels2 = hidden / kPanel;
  at::parallel_for(0, panels2 * n_active, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = t / n_active, e = active[t % n_active];
      const int64_t first = start[e];
      if (t + 1 < end) prefetch_panel(w2[active[(t + 1) % n_active]], (t + 1) / n_active, inter,
                                    sizeof(T));
      run_panel<T>(
          w2[e], p, inter, start[e + 1] - first,
          [&](int64_t i) { return act.get() + (first + i) * inter; },
          [&](int64_t i) { return actf + (first + i) * inter; },
          [&](int64_t i) { return actq.at(first + i); },
          [&](int64_t r0, int mm, const float* sums) {
            const float* bias = epi.b2 != nullptr ? epi.b2 + e * hidden + p * kPanel : nullptr;
            for (int r = 0; r < mm; ++r) {
              const f16v scale = splat(route[order[first + r0 + r]]);
              float* y = ys.get() + (first + r0 + r) * hidden + p * kPanel;
              for (int v = 0; v < 4; ++v) {
                f16v sum = load(sums + r * kPanel + v * kLanes);
                if (bias != nullptr) sum += load(bias + v * kLanes);
                store(y + v * kLanes, sum * scale);
              }
            }
          },
          kAmxMinRowsExperts);
    }
  });

  // each token's k expert outputs summed in float (in routing order), rounded once
  at::Tensor out = at::empty({tokens, hidden}, x.options());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> total(static_cast<size_t>(hidden));
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(total.data(), ys.get() + position[t * top_k] * hidden, hidden * 4);
      for (int64_t j = 1; j < top_k; ++j) {
        const float* y = ys.get() + position[t * top_k + j] * hidden;
        for (int64_t h = 0; h < hidden; h += kLanes)
          store(total.data() + h, load(total.data() + h) + load(y + h));
      }
      store_row(op + t * hidden, total.data(), static_cast<int>(hidden));
    }
  });
  return out;
}

// The weights of one slot's gate_up or down (n outputs, k inputs) as stored; checked.
Weight slot_weight(const at::Tensor& data, at::TensorList scales, at::TensorList offsets,
                   size_t e, int64_t n, int64_t k, int64_t group, at::ScalarType act) {
  TORCH_CHECK(data.is_contiguous(), "slot ", e, ": weights must be contiguous");
  const auto type = data.scalar_type();
  if (type == at::kChar && e < offsets.size() && offsets[e].scalar_type() == at::kInt) {
    TORCH_CHECK(kHasVnni, "w8a8 experts need AVX512-VNNI");
    TORCH_CHECK(data.numel() == n * k && k % 4 == 0 && e < scales.size() &&
                    scales[e].scalar_type() == at::kFloat && scales[e].is_contiguous() &&
                    scales[e].numel() == n && offsets[e].is_contiguous() &&
                    offsets[e].numel() == n,
                "slot ", e, ": w8a8 needs (n, k) int8 weights, n float32 scales, n int32 comps");
    return weight_of(data, &scales[e], &offsets[e], group);
  }
  if (type == at::kFloat8_e4m3fn) {  // fp8 with a scale per (block of 128 inputs, channel)
    TORCH_CHECK(group == kFp8Block && data.numel() == n * k && e < scales.size() &&
                    scales[e].scalar_type() == at::kFloat && scales[e].is_contiguous() &&
                    scales[e].numel() == n * ((k + kFp8Block - 1) / kFp8Block),
                "slot ", e, ": fp8 needs group 128 and a float32 scale per (block, channel)");
    return weight_of(data, &scales[e], nullptr, group);
  }
  if (type == at::kByte && data.dim() == 4 && e < scales.size() &&
      scales[e].scalar_type() == at::kByte) {  // MXFP4 codes and their E8M0 exponents
    TORCH_CHECK(kHasVnni && group == 32 && k % group == 0 && data.numel() == n * k / 2 &&
                    scales[e].is_contiguous() && scales[e].numel() == n * k / group,
                "slot ", e, ": MXFP4 needs AVX512-VNNI, groups of 32 and one exponent a "
                "(group, channel)");
    return weight_of(data, &scales[e], nullptr, group);
  }
  if (type == at::kChar || type == at::kByte) {
    const bool int4 = type == at::kByte;  // (or 5-bit codes: the VNNI layout, third dim 5)
    const bool five = int4 && data.dim() == 4 && data.size(2) == 5;
    TORCH_CHECK(data.numel() == (five ? n * k / 8 * 5 : int4 ? n * k / 2 : n * k) &&
                    e < scales.size(),
                "slot ", e, ": quantized weights of the wrong size, or no scales");
    const int64_t per_channel = int4 ? k / group : 1;
    // int4 in the VNNI layout keeps its scales and offsets in float16
    const auto scale_type = int4 && data.dim() == 4 ? at::kHalf : at::kFloat;
    TORCH_CHECK(scales[e].scalar_type() == scale_type && scales[e].is_contiguous() &&
                    scales[e].numel() == n * per_channel,
                "slot ", e, ": scales must be contiguous ", scale_type, ", ", n * per_channel,
                " values");
    if (int4) {
      TORCH_CHECK(group > 0 && group % 2 == 0 && k % group == 0 && e < offsets.size() &&
                      offsets[e].scalar_type() == scale_type && offsets[e].is_contiguous() &&
                      offsets[e].numel() == n * per_channel,
                  "slot ", e, ": int4 needs a group dividing K and offsets like its scales");
    }
    TORCH_CHECK(data.dim() != 4 || (kHasVnni && group % 8 == 0),
                "slot ", e, ": int4 in the VNNI layout needs AVX512-VNNI and groups of 8k");
    return weight_of(data, &scales[e], int4 ? &offsets[e] : nullptr, group);
  }
  TORCH_CHECK(type == act && data.numel() == n * k,
              "slot ", e, ": weights of the wrong size or dtype");
  return weight_of(data, nullptr, nullptr, 0);
}

}  // namespace

namespace evenflow_ops {

// x (T, H) float32 or bfloat16; ids (T, k) int64 slot ids; route_weights (T, k) float32;
// w13[e] / w2[e]: slot e's gate_up and down weights in a panel layout: plain in x's dtype, or
// int8 / int4 with their scales (and int4 offsets, `group` inputs a group) per slot.
at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& route_weights,
                     at::TensorList w13, at::TensorList w2, at::TensorList scales13,
                     at::TensorList scales2, at::TensorList offsets13, at::TensorList offsets2,
                     int64_t group_word, const std::optional<at::Tensor>& b13,
                     const std::optional<at::Tensor>& b2, int64_t activation, double alpha,
                     double limit) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous (T, H) matrix");
  const GroupWord word = split_group(group_word);  // (the kernel plans' thresholds with it)
  const int64_t group = word.group;
  TORCH_CHECK(ids.dim() == 2 && ids.is_contiguous() && ids.scalar_type() == at::kLong &&
                  ids.size(0) == x.size(0),
              "ids must be a contiguous (T, k) int64 matrix");
  TORCH_CHECK(route_weights.sizes() == ids.sizes() && route_weights.is_contiguous() &&
                  route_weights.scalar_type() == at::kFloat,
              "route_weights must be a contiguous float32 matrix shaped like ids");
  TORCH_CHECK(!w13.empty() && w13.size() == w2.size(), "one gate_up and one down per slot");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "x must be float32 or bfloat16");
  TORCH_CHECK(!bf16 || kHasBf16Dot, "bfloat16 fused MoE needs AVX512-BF16");
  const int64_t hidden = x.size(1);
  // (bytes a weight: int4 codes 1/2, 5-bit codes (the VNNI layout's third dim 5) 5/8)
  const at::Tensor& d0 = w2[0];
  const bool five = d0.scalar_type() == at::kByte && d0.dim() == 4 && d0.size(2) == 5;
  const int64_t inter = five ? d0.numel() * 8 / 5 / hidden
                             : d0.numel() * (d0.scalar_type() == at::kByte ? 2 : 1) / hidden;
  TORCH_CHECK(hidden % kPanel == 0 && inter % kPanel == 0,
              "hidden and intermediate sizes must be multiples of 64");
  std::vector<Weight> gate_up, down;
  for (size_t e = 0; e < w13.size(); ++e) {
    gate_up.push_back(slot_weight(w13[e], scales13, offsets13, e, 2 * inter, hidden, group,
                                  x.scalar_type()));
    down.push_back(slot_weight(w2[e], scales2, offsets2, e, hidden, inter, group,
                               x.scalar_type()));
    gate_up.back().dequant_from = word.dequant_from;
    down.back().dequant_from = word.dequant_from2;
    // (gate_up and down may differ: a GGUF Q4_K_M keeps some downs in Q6_K)
    TORCH_CHECK(gate_up.back().format == gate_up[0].format &&
                    down.back().format == down[0].format,
                "every slot's gate_up (and every slot's down) must be stored alike");
    TORCH_CHECK((gate_up[0].format == Format::kPlain) == (down[0].format == Format::kPlain),
                "gate_up and down must both be quantized or both plain");
  }
  ExpertEpilogue epi;
  const int64_t slots = static_cast<int64_t>(w13.size());
  if (b13.has_value()) {
    TORCH_CHECK(b13->scalar_type() == at::kFloat && b13->is_contiguous() &&
                    b13->numel() == slots * 2 * inter,
                "b13 must be a contiguous float32 (slots, 2 * intermediate) matrix");
    epi.b13 = b13->data_ptr<float>();
  }
  if (b2.has_value()) {
    TORCH_CHECK(b2->scalar_type() == at::kFloat && b2->is_contiguous() &&
                    b2->numel() == slots * hidden,
                "b2 must be a contiguous float32 (slots, hidden) matrix");
    epi.b2 = b2->data_ptr<float>();
  }
  TORCH_CHECK(activation == kSiluMul || activation == kClampedSwiglu,
              "activation: 0 silu(gate) * up, 1 clamped SwiGLU");
  epi.activation = activation;
  epi.alpha = static_cast<float>(alpha);
  epi.limit = static_cast<float>(limit);
  if (bf16) return fused_moe_impl<uint16_t>(x, ids, route_weights, gate_up, down, inter, epi);
  return fused_moe_impl<float>(x, ids, route_weights, gate_up, down, inter, epi, w13, w2);
}

}  // namespace evenflow_ops

TORCH_LIBRARY_FRAGMENT(evenflow_kernels, m) {
  m.def("fused_moe(Tensor x, Tensor ids, Tensor route_weights, Tensor[] w13, Tensor[] w2, "
        "Tensor[] scales13, Tensor[] scales2, Tensor[] offsets13, Tensor[] offsets2, int group, "
        "Tensor? b13=None, Tensor? b2=None, int activation=0, float alpha=1.0, float limit=0.0) "
        "-> Tensor");
  m.def("fused_moe_bf16_supported", []() { return kHasBf16Dot; });
  m.def("w8a8_supported", []() { return kHasVnni && kPanelsFast; });
  m.def("panel_kernels_fast", []() { return kPanelsFast; });
  m.def("panel_kernels_f32_fast", []() { return kPanelsF32Fast; });
}

TORCH_LIBRARY_IMPL(evenflow_kernels, CPU, m) {
  m.impl("fused_moe", &evenflow_ops::fused_moe);
}
