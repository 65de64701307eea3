// MoE routing in one call: softmax over the router's logits, the top k experts, their weights
// (renormalized to sum 1 when the model says so), and the per-expert pair counts EPLB gathers.
// From Python that is ~7 small ops per layer (upcast, softmax, topk, sum, div, bincount, add),
// whose dispatch at decode batch 1 costs more than the arithmetic.
//
//   route_topk(logits (T, >= E), E, k, renormalize, counts? (>= E,) int64, added to in place)
//     -> (weights (T, k) float32, experts (T, k) int64)
//
// The logits may carry padding columns past E (the panel linear's router gives a whole panel
// of 64); only the first E count. The arithmetic is ATen's own softmax and topk on the float32
// logits, called from here: the same results as the torch ops, ties included (topk's order
// among equal probabilities is its implementation's, and bf16 logits do tie), so greedy output
// stays token-identical with transformers. Renormalizing one or two weights is done here (the
// same single rounding as ATen's sum and divide); more go through ATen's ops.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "ops.h"

namespace evenflow_ops {

std::tuple<at::Tensor, at::Tensor> route_topk(const at::Tensor& logits, int64_t num_experts,
                                              int64_t top_k, bool renormalize,
                                              const std::optional<at::Tensor>& counts) {
  TORCH_CHECK(logits.dim() == 2, "route_topk: logits must be (T, E)");
  TORCH_CHECK(num_experts >= 1 && logits.size(1) >= num_experts,
              "route_topk: logits have fewer columns than experts");
  TORCH_CHECK(top_k >= 1 && top_k <= num_experts, "route_topk: k must be in [1, E]");
  const at::Tensor probs = at::softmax(logits.narrow(1, 0, num_experts).to(at::kFloat), -1);
  auto [weights, experts] = at::topk(probs, top_k, -1);
  if (renormalize && top_k <= 2 && weights.is_contiguous()) {
    // w / (w0 + w1) in place: what the ATen sum and divide give for one or two terms (a sum
    // of two floats has one rounding in any order; w / w is 1), without their two ops
    float* w = weights.data_ptr<float>();
    for (int64_t t = 0; t < weights.size(0); ++t, w += top_k) {
      const float total = top_k == 1 ? w[0] : w[0] + w[1];
      for (int64_t j = 0; j < top_k; ++j) w[j] /= total;
    }
  } else if (renormalize) {  // (ATen's reduction order for more terms)
    weights = weights / weights.sum(-1, true);
  }
  if (counts.has_value()) {
    at::Tensor c = *counts;
    TORCH_CHECK(c.scalar_type() == at::kLong && c.dim() == 1 && c.size(0) >= num_experts &&
                    c.is_contiguous(),
                "route_topk: counts must be a contiguous int64 vector of >= E entries");
    const at::Tensor ids = experts.contiguous();
    const int64_t* id = ids.data_ptr<int64_t>();
    int64_t* cp = c.data_ptr<int64_t>();
    for (int64_t i = 0; i < ids.numel(); ++i) ++cp[id[i]];
  }
  return {weights, experts};
}

}  // namespace evenflow_ops

TORCH_LIBRARY_FRAGMENT(evenflow_kernels, m) {
  m.def("route_topk(Tensor logits, int num_experts, int top_k, bool renormalize, "
        "Tensor(a!)? counts=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(evenflow_kernels, CPU, m) {
  m.impl("route_topk", &evenflow_ops::route_topk);
}
