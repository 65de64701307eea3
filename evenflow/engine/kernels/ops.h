// The kernels' entry points as C++ functions, for kernels that call others directly
// (decode_stack.cpp) without the dispatcher; each is also registered as a torch op under
// torch.ops.evenflow_kernels by the file that defines it.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace evenflow_ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& w,
                        const std::optional<at::Tensor>& bias,
                        const std::optional<at::Tensor>& scale,
                        const std::optional<at::Tensor>& offset, int64_t group);
at::Tensor rotary_kv_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& slot_mapping, int64_t heads, int64_t kv_heads);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& slots,
                                  const at::Tensor& lens, double scale,
                                  const std::optional<at::Tensor>& sinks = std::nullopt);
at::Tensor paged_decode_attention_int8(const at::Tensor& q, const at::Tensor& k_cache,
                                       const at::Tensor& v_cache, const at::Tensor& k_scales,
                                       const at::Tensor& v_scales, const at::Tensor& slots,
                                       const at::Tensor& lens, double scale,
                                       int64_t block_size,
                                       const std::optional<at::Tensor>& sinks = std::nullopt);
void kv_write_int8(const at::Tensor& x, const at::Tensor& cache, const at::Tensor& scales,
                   const at::Tensor& slot_mapping, int64_t block_size);
std::tuple<at::Tensor, at::Tensor> route_topk(const at::Tensor& logits, int64_t num_experts,
                                              int64_t top_k, bool renormalize,
                                              const std::optional<at::Tensor>& counts);
at::Tensor fused_moe(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& route_weights,
                     at::TensorList w13, at::TensorList w2, at::TensorList scales13,
                     at::TensorList scales2, at::TensorList offsets13, at::TensorList offsets2,
                     int64_t group, const std::optional<at::Tensor>& b13 = std::nullopt,
                     const std::optional<at::Tensor>& b2 = std::nullopt, int64_t activation = 0,
                     double alpha = 1.0, double limit = 0.0);

}  // namespace evenflow_ops
