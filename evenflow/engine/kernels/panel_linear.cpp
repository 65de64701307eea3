// A dense linear layer over a weight in the panel layout (kernels/panel.h): out = x @ w.T
// (+ bias), x and out float32 or bfloat16.
//
// Why: oneDNN's linear costs ~20 µs a call before it reads a byte (measured by `evenflow bench
// kernels`: a 16x512 weight, one row, 25 µs), and a decode step makes three such calls a layer
// for a few rows. This kernel starts at once and streams each panel of the weight once per
// block of rows; at prefill its register blocking keeps it level with oneDNN (the same panels
// serve the fused MoE kernel at 2,048 tokens faster than oneDNN's per-expert calls).
//
// Threads: ATen's pool over (row block, panel) tasks. Compiled at first use with
// -march=native by evenflow/engine/native.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "panel.h"

namespace {

using namespace evenflow_panel;

constexpr int64_t kRowBlock = 16 * kRows;  // rows a task takes (the panel stays in L2)

template <typename T>
void linear_impl(const T* x, int64_t rows, int64_t k_total, const T* w, int64_t n_total,
                 const float* bias, T* out) {
  const int64_t panels = n_total / kPanel;
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, panels * row_blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[kRows * kPanel];
    const T* xs[kRows];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = t / panels, p = t % panels;
      const T* panel_w = w + p * kPanel * k_total;
      const int64_t last = std::min(rows, (block + 1) * kRowBlock);
      for (int64_t r0 = block * kRowBlock; r0 < last; r0 += kRows) {
        const int m = static_cast<int>(std::min<int64_t>(kRows, last - r0));
        for (int r = 0; r < m; ++r) xs[r] = x + (r0 + r) * k_total;
        panel(xs, m, panel_w, k_total, sums);
        for (int r = 0; r < m; ++r) {
          float* row = sums + r * kPanel;
          if (bias != nullptr)
            for (int v = 0; v < kPanel; v += kLanes)
              store(row + v, load(row + v) + load(bias + p * kPanel + v));
          store_row(out + (r0 + r) * n_total + p * kPanel, row, kPanel);
        }
      }
    }
  });
}

// x (M, K); w: the packed weight ((N/64, K/2, 64, 2) bf16 or (N/64, K, 64) f32, x's dtype);
// bias: (N,) float32 or none.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous (M, K) matrix");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == x.scalar_type(),
              "the packed weight must be contiguous, in x's dtype");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "x must be float32 or bfloat16");
  TORCH_CHECK(!bf16 || kHasBf16Dot, "bfloat16 panel linear needs AVX512-BF16");
  const int64_t k_total = x.size(1);
  const bool layout = bf16 ? (w.dim() == 4 && w.size(1) * 2 == k_total && w.size(2) == kPanel &&
                              w.size(3) == 2)
                           : (w.dim() == 3 && w.size(1) == k_total && w.size(2) == kPanel);
  TORCH_CHECK(layout, "the weight is not in the panel layout for ", k_total, " inputs");
  const int64_t n_total = w.size(0) * kPanel;
  const float* bias_p = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == n_total,
                "bias must be a contiguous float32 vector of ", n_total, " values");
    bias_p = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({x.size(0), n_total}, x.options());
  if (bf16) {
    linear_impl(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.size(0), k_total,
                reinterpret_cast<const uint16_t*>(w.data_ptr()), n_total, bias_p,
                reinterpret_cast<uint16_t*>(out.data_ptr()));
  } else {
    linear_impl(x.data_ptr<float>(), x.size(0), k_total, w.data_ptr<float>(), n_total, bias_p,
                out.data_ptr<float>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(evenflow_kernels, m) {
  m.def("panel_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(evenflow_kernels, CPU, m) { m.impl("panel_linear", &panel_linear); }
