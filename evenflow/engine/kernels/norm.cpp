// RMSNorm, and the residual add fused into it: one pass per row instead of the ~8 small ops
// (upcast, pow, mean, add eps, rsqrt, mul, mul weight, downcast) torch runs for a bf16 norm,
// which at decode batch 1 cost more than the arithmetic.
//
//   rms_norm(x, w, eps)               -> x * rsqrt(mean(x^2) + eps) * w
//   add_rms_norm(x, residual, w, eps) -> (s, rms_norm(s, w, eps)) with s = x + residual
//
// Math in float32, each output rounded once to the input dtype, as torch's rms_norm does; the
// sum s is rounded to the input dtype before it is normalized, as `x + residual` followed by a
// norm would. Threads: ATen's pool over rows (a single row stays on the calling thread).
// Vectorized: converting bf16 one value at a time through c10::BFloat16 made a 32-row norm of
// 512 take ~40 us, more than the batch-32 step's attention projections.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "ops.h"
#include "panel.h"

namespace {

using namespace evenflow_panel;

// Rows in 16-lane vectors (the sum of squares in 16 partial sums, then added up); a tail of
// dim % 16 in scalars. Each sum x + residual is rounded to T before it is squared, as torch's
// separate add and norm round it.
template <typename T>
void norm_rows(const T* x, const T* residual, const T* weight, T* sum_out, T* out,
               int64_t rows, int64_t dim, float eps) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(dim, 1));
  const int64_t body = dim - dim % kLanes;
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * dim;
      T* outr = out + r * dim;
      f16v partial = {};
      float squares = 0.f;
      if (residual != nullptr) {
        const T* rr = residual + r * dim;
        T* sr = sum_out + r * dim;
        for (int64_t d = 0; d < body; d += kLanes) {
          store16(sr + d, load16(xr + d) + load16(rr + d));
          const f16v f = load16(sr + d);  // (rounded to T)
          partial += f * f;
        }
        for (int64_t d = body; d < dim; ++d) {
          const T s = static_cast<T>(static_cast<float>(xr[d]) + static_cast<float>(rr[d]));
          sr[d] = s;
          const float f = static_cast<float>(s);
          squares += f * f;
        }
        xr = sr;
      } else {
        for (int64_t d = 0; d < body; d += kLanes) {
          const f16v f = load16(xr + d);
          partial += f * f;
        }
        for (int64_t d = body; d < dim; ++d) {
          const float f = static_cast<float>(xr[d]);
          squares += f * f;
        }
      }
      for (int i = 0; i < kLanes; ++i) squares += partial[i];
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
      const f16v inv_v = splat(inv);
      for (int64_t d = 0; d < body; d += kLanes)
        store16(outr + d, load16(xr + d) * inv_v * load16(weight + d));
      for (int64_t d = body; d < dim; ++d)
        outr[d] = static_cast<T>(static_cast<float>(xr[d]) * inv * static_cast<float>(weight[d]));
    }
  });
}

void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.is_contiguous() && x.dim() >= 1, "x must be contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous (dim,) tensor of x's dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "rms_norm takes float32 or bfloat16");
}

template <typename Fn>
void dispatch(const at::Tensor& x, Fn fn) {
  if (x.scalar_type() == at::kFloat)
    fn(float{});
  else
    fn(c10::BFloat16{});
}

}  // namespace

namespace evenflow_ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight);
  auto out = at::empty_like(x);
  const int64_t dim = x.size(-1), rows = x.numel() / std::max<int64_t>(dim, 1);
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    norm_rows<T>(x.data_ptr<T>(), nullptr, weight.data_ptr<T>(), nullptr, out.data_ptr<T>(),
                 rows, dim, static_cast<float>(eps));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() &&
                  residual.scalar_type() == x.scalar_type(),
              "residual must be a contiguous tensor of x's shape and dtype");
  auto sum = at::empty_like(x);
  auto out = at::empty_like(x);
  const int64_t dim = x.size(-1), rows = x.numel() / std::max<int64_t>(dim, 1);
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    norm_rows<T>(x.data_ptr<T>(), residual.data_ptr<T>(), weight.data_ptr<T>(),
                 sum.data_ptr<T>(), out.data_ptr<T>(), rows, dim, static_cast<float>(eps));
  });
  return {sum, out};
}

}  // namespace evenflow_ops

TORCH_LIBRARY_FRAGMENT(evenflow_kernels, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(evenflow_kernels, CPU, m) {
  m.impl("rms_norm", &evenflow_ops::rms_norm);
  m.impl("add_rms_norm", &evenflow_ops::add_rms_norm);
}
