// A decode-only step's MoE decoder layers in one call: the same kernel calls, with the same
// arguments in the same order, as engine/model/decode_stack.py's FastDecodeLayer makes from Python,
// made from C++ without the Python frames and the dispatcher between them (the result is
// bit-identical). A DecodeStack holds every layer's weights once (add_layer, when the engine
// first decodes); each step passes only what changes: the hidden states, rotary rows, caches and
// the attention's slot tables. At batch 1 the ~120 Python-side kernel calls a step cost about
// as much as the attention, norms, rotary and routing kernels together.
//
// Each kernel call is a profiler range of the kernel's op name, inside ranges named as
// engine/profiling.py names the modules' (norm, attention, moe): `evenflow profile` shows the
// step kernel by kernel and component by component as on the module path.

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "ops.h"

namespace {

// f() inside a profiler range (a thread-local check when no profiler runs)
template <typename F>
auto scoped(const char* name, const F& f) {
  RECORD_FUNCTION(name, std::vector<c10::IValue>());
  return f();
}

// panel_linear's arguments after x
struct PanelArgs {
  at::Tensor weight;
  std::optional<at::Tensor> bias, scale, offset;
  int64_t group = 0;

  at::Tensor operator()(const at::Tensor& x) const {
    return scoped("evenflow_kernels::panel_linear", [&] {
      return evenflow_ops::panel_linear(x, weight, bias, scale, offset, group);
    });
  }
};

PanelArgs panel_args(const c10::List<std::optional<at::Tensor>>& tensors, int64_t group) {
  TORCH_CHECK(tensors.size() == 4 && tensors.get(0).has_value(),
              "a linear is [weight, bias, scale, offset]");
  return {*tensors.get(0), tensors.get(1), tensors.get(2), tensors.get(3), group};
}

struct Layer {
  at::Tensor in_norm, post_norm;
  double in_eps = 0, post_eps = 0;
  PanelArgs qkv, o, gate;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  double scale = 0;
  int64_t num_experts = 0, top_k = 0;
  bool renormalize = false;
  std::optional<at::Tensor> counts;
  // under an expert placement (engine/model/placement.py's SlotPlacement): log2phy (E, R) int64,
  // cum_share (E, R) float32, and the (P,) slot counts EPLB reads, or undefined
  at::Tensor log2phy, cum_share;
  std::optional<at::Tensor> slot_counts;
  std::vector<at::Tensor> w13, w2, scales13, scales2, offsets13, offsets2;
  int64_t group = 0;
};

// SlotPlacement.slots_for, exactly: pair i of the flat (T * k) routing takes the replica whose
// cumulative share first exceeds frac(i * golden) (a low-discrepancy spread over replicas);
// the slot counts grow as the module path's bincount adds them.
constexpr double kGolden = 0.6180339887498949;

at::Tensor slots_for(const Layer& layer, const at::Tensor& experts) {
  const at::Tensor ids = experts.contiguous();
  at::Tensor slots = at::empty_like(ids);
  const int64_t pairs = ids.numel(), replicas = layer.log2phy.size(1);
  const int64_t* expert = ids.data_ptr<int64_t>();
  const int64_t* log2phy = layer.log2phy.data_ptr<int64_t>();
  const float* cum = layer.cum_share.data_ptr<float>();
  int64_t* slot = slots.data_ptr<int64_t>();
  int64_t* counts = layer.slot_counts.has_value() ? layer.slot_counts->data_ptr<int64_t>()
                                                  : nullptr;
  for (int64_t i = 0; i < pairs; ++i) {
    const double v = static_cast<double>(i) * kGolden;
    const float u = static_cast<float>(v - std::trunc(v));
    const int64_t row = expert[i] * replicas;
    int64_t replica = 0;
    for (int64_t r = 0; r < replicas; ++r) replica += u >= cum[row + r];
    slot[i] = log2phy[row + std::min(replica, replicas - 1)];
    if (counts != nullptr) ++counts[slot[i]];
  }
  return slots;
}

// the step around the layers: embedding rows, rotary rows, the final norm and lm_head
struct Head {
  at::Tensor embed, cos, sin, norm;
  double eps = 0;
  PanelArgs lm_head;
  int64_t vocab = 0;
};

struct DecodeStack : torch::CustomClassHolder {
  std::vector<Layer> layers;
  std::optional<Head> head;

  // embed (V, H); cos, sin: the rotary tables (positions, hd); norm: the final norm's weight;
  // lm_head: [weight, bias, scale, offset] with its group, `vocab` of its outputs kept
  void set_head(at::Tensor embed, at::Tensor cos, at::Tensor sin, at::Tensor norm, double eps,
                c10::List<std::optional<at::Tensor>> lm_head, int64_t group, int64_t vocab) {
    head = Head{std::move(embed), std::move(cos), std::move(sin), std::move(norm), eps,
                panel_args(lm_head, group), vocab};
  }

  // norms: [input, post-attention] weights; eps: theirs, then the attention's scale; linears:
  // [weight, bias, scale, offset] each with `linear_groups` [qkv, o, gate]; shape: [heads,
  // kv_heads, head_dim, num_experts, top_k]; placement: [log2phy, cum_share, slot_counts] or
  // three Nones; experts: fused_moe's weight lists [w13, w2, scales13, scales2, offsets13,
  // offsets2]
  void add_layer(std::vector<at::Tensor> norms, std::vector<double> eps,
                 c10::List<std::optional<at::Tensor>> qkv,
                 c10::List<std::optional<at::Tensor>> o,
                 c10::List<std::optional<at::Tensor>> gate, std::vector<int64_t> linear_groups,
                 std::vector<int64_t> shape, bool renormalize, std::optional<at::Tensor> counts,
                 c10::List<std::optional<at::Tensor>> placement,
                 std::vector<std::vector<at::Tensor>> experts, int64_t group) {
    TORCH_CHECK(norms.size() == 2 && eps.size() == 3 && linear_groups.size() == 3 &&
                    shape.size() == 5 && experts.size() == 6 && placement.size() == 3,
                "add_layer: 2 norms, 2 eps and a scale, 3 linear groups, 5 shape values, "
                "[log2phy, cum_share, slot_counts], 6 expert lists");
    Layer layer;
    layer.in_norm = norms[0];
    layer.post_norm = norms[1];
    layer.in_eps = eps[0];
    layer.post_eps = eps[1];
    layer.qkv = panel_args(qkv, linear_groups[0]);
    layer.o = panel_args(o, linear_groups[1]);
    layer.gate = panel_args(gate, linear_groups[2]);
    layer.heads = shape[0];
    layer.kv_heads = shape[1];
    layer.head_dim = shape[2];
    layer.scale = eps[2];
    layer.num_experts = shape[3];
    layer.top_k = shape[4];
    layer.renormalize = renormalize;
    layer.counts = std::move(counts);
    if (placement.get(0).has_value()) {
      const at::Tensor log2phy = *placement.get(0), cum = *placement.get(1);
      TORCH_CHECK(log2phy.scalar_type() == at::kLong && log2phy.dim() == 2 &&
                      log2phy.is_contiguous() && cum.scalar_type() == at::kFloat &&
                      cum.sizes() == log2phy.sizes() && cum.is_contiguous() &&
                      log2phy.size(0) == shape[3],
                  "add_layer: a placement is log2phy (E, R) int64 and cum_share (E, R) float32");
      layer.log2phy = log2phy;
      layer.cum_share = cum;
      layer.slot_counts = placement.get(2);
    }
    layer.w13 = std::move(experts[0]);
    layer.w2 = std::move(experts[1]);
    layer.scales13 = std::move(experts[2]);
    layer.scales2 = std::move(experts[3]);
    layer.offsets13 = std::move(experts[4]);
    layer.offsets2 = std::move(experts[5]);
    layer.group = group;
    layers.push_back(std::move(layer));
  }

  int64_t size() const { return static_cast<int64_t>(layers.size()); }
};

// x (T, H): the embedded tokens -> (the residual stream, the last layer's MoE output not yet
// added to it), as CausalLM.forward's layer loop leaves them
std::tuple<at::Tensor, at::Tensor> run_layers(
    const DecodeStack& stack, at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
    at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping,
    const at::Tensor& slots, const at::Tensor& lens, at::TensorList k_scales,
    at::TensorList v_scales, int64_t block_size) {
  const auto& layers = stack.layers;
  TORCH_CHECK(!layers.empty() && k_caches.size() == layers.size() &&
                  v_caches.size() == layers.size(),
              "decode_stack: one K and one V cache a layer");
  // an int8 cache (engine/model/kv_quant.py): its scales, one K and one V tensor a layer
  const bool quantized = !k_scales.empty();
  TORCH_CHECK(!quantized || (k_scales.size() == layers.size() &&
                             v_scales.size() == layers.size()),
              "decode_stack: one K and one V scale tensor a layer, or none");
  const int64_t tokens = x.size(0);
  at::Tensor pending, h;
  for (size_t i = 0; i < layers.size(); ++i) {
    const Layer& layer = layers[i];
    scoped("norm", [&] {
      if (!pending.defined()) {
        h = scoped("evenflow_kernels::rms_norm",
                   [&] { return evenflow_ops::rms_norm(x, layer.in_norm, layer.in_eps); });
      } else {
        std::tie(x, h) = scoped("evenflow_kernels::add_rms_norm", [&] {
          return evenflow_ops::add_rms_norm(pending, x, layer.in_norm, layer.in_eps);
        });
      }
    });
    const at::Tensor attn = scoped("attention", [&] {
      const at::Tensor qkv = layer.qkv(h).view(
          {tokens, layer.heads + 2 * layer.kv_heads, layer.head_dim});
      if (quantized) {  // rotated K and V into a scratch (row t = token t), then quantized
        const at::Tensor k = at::empty({tokens, layer.kv_heads, layer.head_dim}, qkv.options());
        const at::Tensor v = at::empty_like(k);
        const at::Tensor q = scoped("evenflow_kernels::rotary_kv_write", [&] {
          return evenflow_ops::rotary_kv_write(qkv, cos, sin, k, v,
                                               at::arange(tokens, slot_mapping.options()),
                                               layer.heads, layer.kv_heads);
        });
        scoped("evenflow_kernels::kv_write_int8", [&] {
          evenflow_ops::kv_write_int8(k, k_caches[i], k_scales[i], slot_mapping, block_size);
          evenflow_ops::kv_write_int8(v, v_caches[i], v_scales[i], slot_mapping, block_size);
        });
        const at::Tensor out = scoped("evenflow_kernels::paged_decode_attention_int8", [&] {
          return evenflow_ops::paged_decode_attention_int8(q, k_caches[i], v_caches[i],
                                                           k_scales[i], v_scales[i], slots,
                                                           lens, layer.scale, block_size);
        });
        return layer.o(out.view({tokens, layer.heads * layer.head_dim}));
      }
      const at::Tensor q = scoped("evenflow_kernels::rotary_kv_write", [&] {
        return evenflow_ops::rotary_kv_write(qkv, cos, sin, k_caches[i], v_caches[i],
                                             slot_mapping, layer.heads, layer.kv_heads);
      });
      const at::Tensor out = scoped("evenflow_kernels::paged_decode_attention", [&] {
        return evenflow_ops::paged_decode_attention(q, k_caches[i], v_caches[i], slots, lens,
                                                    layer.scale);
      });
      return layer.o(out.view({tokens, layer.heads * layer.head_dim}));
    });
    scoped("norm", [&] {
      std::tie(x, h) = scoped("evenflow_kernels::add_rms_norm", [&] {
        return evenflow_ops::add_rms_norm(x, attn, layer.post_norm, layer.post_eps);
      });
    });
    pending = scoped("moe", [&] {
      const at::Tensor logits = layer.gate(h);
      auto [weights, experts] = scoped("evenflow_kernels::route_topk", [&] {
        return evenflow_ops::route_topk(logits, layer.num_experts, layer.top_k,
                                        layer.renormalize, layer.counts);
      });
      const at::Tensor slots = layer.log2phy.defined() ? slots_for(layer, experts) : experts;
      return scoped("evenflow_kernels::fused_moe", [&] {
        return evenflow_ops::fused_moe(h, slots.contiguous(), weights.contiguous(), layer.w13,
                                       layer.w2, layer.scales13, layer.scales2, layer.offsets13,
                                       layer.offsets2, layer.group);
      });
    });
  }
  return {x, pending};
}

std::tuple<at::Tensor, at::Tensor> decode_stack(
    const c10::intrusive_ptr<DecodeStack>& stack, at::Tensor x, const at::Tensor& cos,
    const at::Tensor& sin, at::TensorList k_caches, at::TensorList v_caches,
    const at::Tensor& slot_mapping, const at::Tensor& slots, const at::Tensor& lens,
    at::TensorList k_scales, at::TensorList v_scales, int64_t block_size) {
  return run_layers(*stack, std::move(x), cos, sin, k_caches, v_caches, slot_mapping, slots,
                    lens, k_scales, v_scales, block_size);
}

// The whole step, as CausalLM.forward makes it when every row is sampled: input_ids and
// positions (T,) int64 -> the logits (T, vocab) float32.
at::Tensor decode_step(const c10::intrusive_ptr<DecodeStack>& stack, const at::Tensor& input_ids,
                       const at::Tensor& positions, at::TensorList k_caches,
                       at::TensorList v_caches, const at::Tensor& slot_mapping,
                       const at::Tensor& slots, const at::Tensor& lens,
                       at::TensorList k_scales, at::TensorList v_scales, int64_t block_size) {
  TORCH_CHECK(stack->head.has_value(), "decode_step: the stack has no head (set_head)");
  const Head& head = *stack->head;
  const at::Tensor x =
      scoped("embed+lm_head", [&] { return head.embed.index_select(0, input_ids); });
  const at::Tensor cos = head.cos.index_select(0, positions).unsqueeze(1);
  const at::Tensor sin = head.sin.index_select(0, positions).unsqueeze(1);
  auto [residual, pending] =
      run_layers(*stack, x, cos, sin, k_caches, v_caches, slot_mapping, slots, lens, k_scales,
                 v_scales, block_size);
  const at::Tensor h = scoped("norm", [&] {
    return std::get<1>(scoped("evenflow_kernels::add_rms_norm", [&] {
      return evenflow_ops::add_rms_norm(pending, residual, head.norm, head.eps);
    }));
  });
  return scoped("embed+lm_head", [&] {
    at::Tensor logits = head.lm_head(h);
    if (logits.size(1) != head.vocab) logits = logits.narrow(1, 0, head.vocab);  // panel padding
    return logits.to(at::kFloat).contiguous();
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(evenflow_kernels, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_head", &DecodeStack::set_head)
      .def("size", &DecodeStack::size);
  m.def("decode_stack", &decode_stack);
  m.def("decode_step", &decode_step);
}
