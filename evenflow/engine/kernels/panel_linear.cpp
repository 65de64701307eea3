// A dense linear layer over a weight in a panel layout (kernels/panel.h, panel_quant.h):
// out = x @ w.T (+ bias), x and out float32 or bfloat16, w plain in x's dtype or weight-only
// int8 / int4.
//
// Why: oneDNN's linear costs ~20 µs a call before it reads a byte (`evenflow bench kernels`:
// a 16x512 weight, one row, 25 µs), and a decode step makes three such calls a layer for a few
// rows. This kernel starts at once and streams each panel of the weight once per block of rows
// (1.3-2.5x oneDNN at 1-32 rows; ~0.8-0.9x at 512+ rows in bf16 on vdpbf16ps. On AMX tiles,
// panel_amx.h, from 2 rows: 1.4-2x oneDNN at 16-96 rows, ~0.8x at 2,048 on an expert's shape).
//
// Threads: ATen's pool over (row block, panel) tasks. Compiled at first use with
// -march=native by evenflow/engine/kernels/native.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "ops.h"
#include "panel_run.h"

namespace {

using namespace evenflow_panel;

constexpr int64_t kRowBlock = 16 * kRows;  // rows a task takes (the panel stays in L2)

// Rows a task takes: kRowBlock, or where a quantized panel is dequantized first, as many as
// keep every thread busy, so that a panel is dequantized once per task and not once per
// kRowBlock rows (a quarter of the work at 2,048 rows of a 512-input weight)
template <typename T>
int64_t row_block(const Weight& wt, int64_t rows, int64_t panels) {
  if (wt.format == Format::kPlain || rows <= kRowBlock || rows < dequant_rows<T>(wt))
    return kRowBlock;
  const int64_t tasks_per_panel =
      std::max<int64_t>(1, (4 * at::get_num_threads() + panels - 1) / panels);
  const int64_t block = (rows + tasks_per_panel - 1) / tasks_per_panel;
  return std::max<int64_t>(kRowBlock, (block + kRows - 1) / kRows * kRows);
}

template <typename T>
void linear_impl(const T* x, const float* xf, const QuantRows* xq, int64_t rows, int64_t k_total,
                 const Weight& wt, int64_t n_total, const float* bias, T* out) {
  const int64_t panels = n_total / kPanel;
  const int64_t block = row_block<T>(wt, rows, panels);
  const int64_t row_blocks = (rows + block - 1) / block;
  at::parallel_for(0, panels * row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = (t / panels) * block, p = t % panels;
      run_panel<T>(
          wt, p, k_total, std::min(rows, first + block) - first,
          [&](int64_t i) { return x + (first + i) * k_total; },
          [&](int64_t i) { return xf + (first + i) * k_total; },
          [&](int64_t i) { return xq->at(first + i); },
          [&](int64_t r0, int mm, float* sums) {
            for (int r = 0; r < mm; ++r) {
              float* row = sums + r * kPanel;
              if (bias != nullptr)
                for (int v = 0; v < kPanel; v += kLanes)
                  store(row + v, load(row + v) + load(bias + p * kPanel + v));
              store_row(out + (first + r0 + r) * n_total + p * kPanel, row, kPanel);
            }
          });
    }
  });
}

template <typename T>
bool few_rows(const Weight& wt, int64_t rows, int64_t panels) {
  const int64_t block = row_block<T>(wt, rows, panels);
  return (rows - 1) % block + 1 < dequant_rows<T>(wt);
}

}  // namespace

namespace evenflow_ops {

// x (M, K); w: the packed weight in a panel layout — (N/64, K/2, 64, 2) bf16 or (N/64, K, 64)
// f32 in x's dtype, (N/64, K, 64) int8 with scale (N,), (N/64, K/2, 64) uint8 int4 nibbles
// (or (N/64, K/8, 64, 4): their VNNI layout, panel_quant.h; (N/64, K/8, 5, 64): 5-bit codes in
// it) with scale and offset
// (N/64, K/group, 64), MXFP4 codes in that VNNI layout with their E8M0 exponents (N/64, K/32,
// 64) uint8 as `scale` and no offset (group 32), fp8: (N/64, K, 64) float8_e4m3fn with scale
// (N/64, ceil(K/128), 64) float32 (group 128), or w8a8: (N/64, K/4, 64, 4) int8 with scale (N,)
// and its int32 comp (N,) as `offset`; bias: (N,) float32 or none.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& scale,
                        const std::optional<at::Tensor>& offset, int64_t group_word) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous (M, K) matrix");
  const GroupWord word = split_group(group_word);
  const int64_t group = word.group;
  TORCH_CHECK(w.is_contiguous(), "the packed weight must be contiguous");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "x must be float32 or bfloat16");
  TORCH_CHECK(!bf16 || kHasBf16Dot, "bfloat16 panel linear needs AVX512-BF16");
  const int64_t k_total = x.size(1);
  const auto type = w.scalar_type();
  bool layout;
  const bool w8a8 = type == at::kChar && offset.has_value() && offset->scalar_type() == at::kInt;
  const bool fp8 = type == at::kFloat8_e4m3fn;
  if (fp8) {
    layout = w.dim() == 3 && w.size(1) == k_total && w.size(2) == kPanel;
  } else if (w8a8) {
    TORCH_CHECK(kHasVnni, "w8a8 panels need AVX512-VNNI");
    layout = w.dim() == 4 && w.size(1) * 4 == k_total && w.size(2) == kPanel && w.size(3) == 4;
  } else if (type == at::kChar) {
    layout = w.dim() == 3 && w.size(1) == k_total && w.size(2) == kPanel;
  } else if (type == at::kByte) {  // int4 nibbles, their VNNI layout (N/64, K/8, 64, 4), or
                                   // 5-bit codes (N/64, K/8, 5, 64)
    layout = (w.dim() == 3 && w.size(1) * 2 == k_total && w.size(2) == kPanel) ||
             (w.dim() == 4 && w.size(1) * 8 == k_total && w.size(2) == kPanel && w.size(3) == 4) ||
             (w.dim() == 4 && w.size(1) * 8 == k_total && w.size(2) == 5 && w.size(3) == kPanel);
  } else {
    TORCH_CHECK(type == x.scalar_type(), "a plain packed weight must be in x's dtype");
    layout = bf16 ? (w.dim() == 4 && w.size(1) * 2 == k_total && w.size(2) == kPanel &&
                     w.size(3) == 2)
                  : (w.dim() == 3 && w.size(1) == k_total && w.size(2) == kPanel);
  }
  TORCH_CHECK(layout, "the weight is not in a panel layout for ", k_total, " inputs");
  const int64_t n_total = w.size(0) * kPanel;
  const bool mxfp4 = type == at::kByte && w.dim() == 4 && scale.has_value() &&
                     scale->scalar_type() == at::kByte;
  if (fp8) {
    TORCH_CHECK(group == kFp8Block && scale.has_value() && scale->scalar_type() == at::kFloat &&
                    scale->is_contiguous() &&
                    scale->numel() == n_total * ((k_total + kFp8Block - 1) / kFp8Block),
                "fp8 panels need group 128 and a float32 scale per (block of 128, channel)");
  } else if (mxfp4) {
    TORCH_CHECK(kHasVnni && group == 32 && k_total % group == 0 && !offset.has_value() &&
                    scale->is_contiguous() && scale->numel() == n_total * k_total / group,
                "MXFP4 panels need AVX512-VNNI, groups of 32, no offset and one exponent a "
                "(group, channel)");
  } else if (type == at::kChar || type == at::kByte) {
    const int64_t per_channel = type == at::kByte ? k_total / std::max<int64_t>(group, 1) : 1;
    // int4 in the VNNI layout keeps its scale and offset in float16
    const auto scale_type = type == at::kByte && w.dim() == 4 ? at::kHalf : at::kFloat;
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == scale_type &&
                    scale->is_contiguous() && scale->numel() == n_total * per_channel,
                "a quantized weight needs a contiguous ", scale_type, " scale of ",
                n_total * per_channel, " values");
    if (w8a8) {
      TORCH_CHECK(offset->is_contiguous() && offset->numel() == n_total,
                  "w8a8 needs a contiguous int32 comp of ", n_total, " values");
    } else if (type == at::kByte) {
      TORCH_CHECK(group > 0 && group % 2 == 0 && k_total % group == 0 && offset.has_value() &&
                      offset->scalar_type() == scale->scalar_type() &&
                      offset->is_contiguous() && offset->numel() == scale->numel(),
                  "int4 needs a group dividing K and an offset shaped and typed like the scale");
      TORCH_CHECK(w.dim() != 4 || (kHasVnni && group % 8 == 0),
                  "int4 in the VNNI layout needs AVX512-VNNI and groups of 8k");
    }
  }
  Weight wt = weight_of(w, scale.has_value() ? &*scale : nullptr,
                        offset.has_value() ? &*offset : nullptr, group);
  wt.dequant_from = word.dequant_from;
  const float* bias_p = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                    bias->numel() == n_total,
                "bias must be a contiguous float32 vector of ", n_total, " values");
    bias_p = bias->data_ptr<float>();
  }
  if (!bf16 && wt.format == Format::kPlain && x.size(0) >= kBlasRows) {
    at::Tensor out = matmul_over_panels(x, w);
    return bias.has_value() ? out.add_(*bias) : out;
  }
  at::Tensor out = at::empty({x.size(0), n_total}, x.options());
  QuantRows xq;
  const int64_t rows = x.size(0);
  // a task's block of rows: row_block's each, the last one the rest; `few`: some block meets
  // a panel as int8 rows (w8a8, W4A8), which are quantized then
  const int64_t panels = n_total / kPanel;
  const bool few = bf16 ? few_rows<uint16_t>(wt, rows, panels) : few_rows<float>(wt, rows, panels);
  if (bf16) {
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
    std::vector<float> copy;
    quantize_rows_for(wt, xb, rows, k_total, few, xq);
    const float* xf =
        few && reads_float_rows<uint16_t>(wt) ? float_rows(xb, x.numel(), copy) : nullptr;
    linear_impl(xb, xf, &xq, rows, k_total, wt, n_total, bias_p,
                reinterpret_cast<uint16_t*>(out.data_ptr()));
  } else {
    quantize_rows_for(wt, x.data_ptr<float>(), rows, k_total, few, xq);
    linear_impl(x.data_ptr<float>(), x.data_ptr<float>(), &xq, rows, k_total, wt, n_total,
                bias_p, out.data_ptr<float>());
  }
  return out;
}

}  // namespace evenflow_ops

namespace {
void set_amx_tiles(bool on) { amx_switched_on().store(on); }
bool amx_tiles() { return amx_usable(); }
}  // namespace

TORCH_LIBRARY_FRAGMENT(evenflow_kernels, m) {
  // bf16 panels on AMX tiles from 16 rows, where built and permitted (panel_amx.h);
  // process-wide
  m.def("set_amx_tiles(bool on) -> ()", &set_amx_tiles);
  m.def("amx_tiles() -> bool", &amx_tiles);
  m.def("panel_linear(Tensor x, Tensor w, Tensor? bias, Tensor? scale=None, "
        "Tensor? offset=None, int group=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(evenflow_kernels, CPU, m) {
  m.impl("panel_linear", &evenflow_ops::panel_linear);
}
