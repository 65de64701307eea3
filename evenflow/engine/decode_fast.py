"""A decode-only step's MoE decoder layer as a straight line of native kernel calls.

At batch 1 a step spends as much time around the operators as in them: module calls, the
panel linears' reshapes and checks, the routing wrapper, the fused MoE's argument lists — ~25
dispatches and as many Python frames a layer for 9 kernels. Where every piece of a layer runs a
native kernel (engine/kernels/*), this runs those same kernels, with the same arguments in the
same order, and nothing else: the result is bit-identical to DecoderLayer.forward's.

It serves a layer when the kernels are built and the layer is the common case: attention
projections as panels (plain, or int8 / int4 panels without a bias), a panel router, no q/k
norm, routed experts on the fused kernel without an expert placement or expert parallelism, no
shared expert, no tensor parallelism. Anything else (and every step with a prefill in it) takes
the module path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from evenflow.engine import native, panels
from evenflow.engine.ffn import MoE
from evenflow.engine.quant_panels import PanelStack

if TYPE_CHECKING:
    from evenflow.engine.model import AttentionMetadata, DecoderLayer


def linear_args(module: Any) -> tuple | None:
    """panel_linear's arguments after x for this linear — what its own forward passes — or
    None where it is not one panel_linear call with whole panels out."""
    if isinstance(module, panels.PanelLinear):
        return module.kernel_args() if module.out_features % panels.PANEL == 0 else None
    stack = getattr(module, "weight_q", None)  # engine/quantize_model.py's QuantLinear
    if isinstance(stack, PanelStack) and module.bias is None and not stack.gate_up:
        return stack.kernel_args()
    return None


class FastDecodeLayer:
    """One layer's decode step; `of(layer)` is None where the layer does not qualify."""

    def __init__(self, layer: DecoderLayer, kernels: dict[str, Any]) -> None:
        attn, moe = layer.self_attn, layer.mlp
        assert isinstance(moe, MoE)
        self.moe = moe
        self.norms, self.rotary = kernels["norms"], kernels["rotary"]
        self.attention, self.linear = kernels["attention"], kernels["linear"]
        self.route = kernels["route"]
        self.in_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        assert isinstance(moe.gate, panels.PanelLinear)
        self.gate: panels.PanelLinear = moe.gate
        self.attn, self.projections = attn, (attn.qkv_proj, attn.o_proj)
        qkv_args, o_args = linear_args(attn.qkv_proj), linear_args(attn.o_proj)
        assert qkv_args is not None and o_args is not None
        self.qkv_args, self.o_args = qkv_args, o_args
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, \
            attn.head_dim
        self.scale = attn.head_dim**-0.5
        self.dtype = self.in_norm.weight.dtype

    @classmethod
    def of(cls, layer: DecoderLayer) -> FastDecodeLayer | None:
        kernels = {"norms": native.norms(), "rotary": native.rotary_kv_write(),
                   "attention": native.decode_attention(), "linear": native.panel_linear(),
                   "route": native.route_topk(), "fused_moe": native.fused_moe()}
        if any(k is None for k in kernels.values()):
            return None
        attn, moe = layer.self_attn, layer.mlp
        if layer.tp is not None or attn.qk_norm or not isinstance(moe, MoE):
            return None
        if linear_args(attn.qkv_proj) is None or linear_args(attn.o_proj) is None or \
                not isinstance(moe.gate, panels.PanelLinear):
            return None
        if moe.shared_expert is not None or moe._fused_experts() is None:
            return None
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if norms[0].dtype != norms[1].dtype:
            return None
        return cls(layer, kernels)

    def usable(self) -> bool:
        """The layer is still as it was made: its projections not replaced, no expert placement
        or expert parallelism come since (the experts' fused stacks stay as loaded without)."""
        attn, moe = self.attn, self.moe
        return attn.qkv_proj is self.projections[0] and attn.o_proj is self.projections[1] and \
            moe.placement is None and moe.ep is None

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, kv: tuple[Tensor, Tensor],
                 meta: AttentionMetadata, pending: Tensor | None = None
                 ) -> tuple[Tensor, Tensor]:
        """DecoderLayer.forward, for a decode-only step on the paged attention."""
        in_norm, post_norm = self.in_norm, self.post_norm
        if pending is None:
            h = self.norms.rms_norm(x, in_norm.weight, in_norm.eps)
        else:
            x, h = self.norms.add_rms_norm(pending, x, in_norm.weight, in_norm.eps)
        T, nh, n_kv, hd = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = self.linear(h, *self.qkv_args).view(T, nh + 2 * n_kv, hd)
        q = self.rotary(qkv, cos, sin, kv[0], kv[1], meta.slot_mapping, nh, n_kv)
        attn = self.attention(q, kv[0], kv[1], meta.decode_slots, meta.decode_lens, self.scale)
        attn = self.linear(attn.view(T, nh * hd), *self.o_args)
        x, h = self.norms.add_rms_norm(x, attn, post_norm.weight, post_norm.eps)
        moe = self.moe
        logits = self.linear(h, *self.gate.kernel_args())
        weights, experts = self.route(logits, moe.num_experts, moe.top_k, moe.norm_topk_prob,
                                      moe.counts)
        fused = moe._fused_experts()
        assert fused is not None
        return x, panels.run_experts(h, experts, weights, *fused)


def fast_layers(layers: list[DecoderLayer]) -> list[FastDecodeLayer] | None:
    """Every layer's fast decode, or None unless all of them qualify."""
    fast = [FastDecodeLayer.of(layer) for layer in layers]
    if not fast or any(f is None for f in fast):
        return None
    return [f for f in fast if f is not None]


def serves(fast: list[FastDecodeLayer], meta: AttentionMetadata, x: Tensor, cos: Tensor,
           kv: tuple[Tensor, Tensor]) -> bool:
    """These layers take this step: decodes only, on the paged attention, one dtype throughout
    (the norms' too), every layer's experts still on the fused kernel."""
    return not meta.prefills and meta.decode_lens is not None and x.is_contiguous() and \
        x.dtype == cos.dtype == kv[0].dtype == fast[0].dtype and all(f.usable() for f in fast)
