"""A decode-only step's MoE decoder layers as one native call.

At batch 1 a step spends as much time around the operators as in them: module calls, the
panel linears' reshapes and checks, the routing wrapper, the fused MoE's argument lists — ~25
dispatches and as many Python frames a layer for 9 kernels. Where every piece of every layer
runs a native kernel (engine/kernels/*), kernels/decode_stack.cpp runs those same kernels, with
the same arguments in the same order, from C++: the result is bit-identical to the layers'
DecoderLayer.forward, and the Python around them is one call a step. FastDecodeLayer decides
whether a layer qualifies and gives the stack its weights; FastDecodeStack holds the C++ stack.

It serves a layer when the kernels are built and the layer is the common case: attention
projections as panels (plain, or int8 / int4 panels without a bias), a panel router, no q/k
norm, RMSNorm before each sublayer, routed experts on the fused kernel (under an expert
placement too — the mesh's workers run under one by default — but without expert
parallelism), no shared expert, no tensor parallelism. Anything else (and every step with a
prefill in it) takes the module path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from evenflow.engine.kernels import native, panels
from evenflow.engine.model.attention import Attention
from evenflow.engine.model.kv_quant import block_size_of
from evenflow.engine.model.metadata import AttentionMetadata
from evenflow.engine.model.moe import MoE
from evenflow.engine.model.norm import RMSNorm
from evenflow.engine.model.transformer import CausalLM, DecoderLayer
from evenflow.engine.quant.panel_stack import PanelStack


def linear_args(module: Any) -> tuple | None:
    """panel_linear's arguments after x for this linear — what its own forward passes — or
    None where it is not one panel_linear call with whole panels out."""
    if isinstance(module, panels.PanelLinear):
        return module.kernel_args() if module.out_features % panels.PANEL == 0 else None
    stack = getattr(module, "weight_q", None)  # engine/weights/quantize_model.py's QuantLinear
    if isinstance(stack, PanelStack) and module.bias is None and not stack.gate_up:
        return stack.kernel_args()
    return None


class FastDecodeLayer:
    """One layer's part of the stack; `of(layer)` is None where the layer does not qualify."""

    def __init__(self, layer: DecoderLayer) -> None:
        attn, moe = layer.self_attn, layer.mlp
        assert isinstance(moe, MoE) and isinstance(attn, Attention)
        self.moe = moe
        # what the stack holds of the experts: their stacks, placement and counts
        self.held = self._experts_state(moe)
        assert isinstance(layer.input_layernorm, RMSNorm)
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
        # (each kernel's own switch, EVENFLOW_NATIVE_*=0, sends its layers to the module path)
        kernels = (native.norms(), native.rotary_kv_write(), native.decode_attention(),
                   native.panel_linear(), native.route_topk(), native.fused_moe())
        if any(k is None for k in kernels) or not hasattr(native.ops(), "decode_stack"):
            return None
        attn, moe = layer.self_attn, layer.mlp
        if not isinstance(attn, Attention) or attn.window or attn.sinks is not None or \
                attn.rotary_dim != attn.head_dim:
            return None  # MLA, sliding windows, sinks and partial rotary take the module path
        if layer.tp is not None or attn.qk_norm or attn.clip_qkv is not None or \
                not isinstance(moe, MoE) or moe.ep is not None:
            return None
        if not moe.routing.plain or moe.score_bias is not None or not moe.plain_experts:
            return None
        if not native.decode_attention_serves(attn.head_dim):
            return None
        if linear_args(attn.qkv_proj) is None or linear_args(attn.o_proj) is None or \
                not isinstance(moe.gate, panels.PanelLinear):
            return None
        if moe.shared_expert is not None or moe.experts_in_use().fused_args() is None:
            return None
        in_norm, post_norm = layer.input_layernorm, layer.post_attention_layernorm
        if not isinstance(in_norm, RMSNorm) or not isinstance(post_norm, RMSNorm):
            return None  # post-norms (no input norm) and LayerNorm take the module path
        if in_norm.weight.dtype != post_norm.weight.dtype:
            return None
        return cls(layer)

    @staticmethod
    def _experts_state(moe: MoE) -> tuple:
        """What the stack copies of a MoE layer's experts: the stacks the fused kernel reads
        (the placed slots' under a placement), the placement, the counts rows."""
        return moe.experts_in_use(), moe.placement, moe.counts, moe.slot_counts

    def usable(self) -> bool:
        """The layer is still as it was made: its projections, experts' stacks, placement and
        counts rows the same, no expert parallelism since (a new placement: a new stack)."""
        modules, moe = self.attn._modules, self.moe  # (not nn.Module's __getattr__: each step)
        if modules["qkv_proj"] is not self.projections[0] or \
                modules["o_proj"] is not self.projections[1] or moe.ep is not None:
            return False
        return all(now is held for now, held in zip(self._experts_state(moe), self.held,
                                                    strict=True))

    def add_to(self, stack: Any) -> None:
        """This layer's weights and shapes into a kernels/decode_stack.cpp DecodeStack."""
        moe = self.moe
        fused = moe.experts_in_use().fused_args()
        assert fused is not None
        if len(fused) == 2:  # plain weights
            w13, w2, s13, s2, o13, o2, group = *fused, [], [], [], [], 0
        else:
            w13, w2, s13, s2, o13, o2, group = fused
        qkv, o, gate = self.qkv_args, self.o_args, self.gate.kernel_args()
        placed = moe.placement
        placement = [None, None, None] if placed is None else [
            placed.log2phy.long().contiguous(), placed.cum_share.float().contiguous(),
            moe.slot_counts]
        stack.add_layer(
            [self.in_norm.weight.data, self.post_norm.weight.data],
            [float(self.in_norm.eps), float(self.post_norm.eps), float(self.scale)],
            list(qkv[:4]), list(o[:4]), list(gate[:4]), [qkv[4], o[4], gate[4]],
            [self.heads, self.kv_heads, self.head_dim, moe.num_experts, moe.top_k],
            bool(moe.routing.renormalize), moe.counts, placement,
            [list(w13), list(w2), list(s13), list(s2), list(o13), list(o2)], int(group))


class FastDecodeStack:
    """Every layer's decode step in one call (kernels/decode_stack.cpp): the kernels
    FastDecodeLayer names, run from C++ in DecoderLayer.forward's order."""

    def __init__(self, layers: list[FastDecodeLayer]) -> None:
        self.layers = layers
        self.dtype = layers[0].dtype
        self.stack = torch.classes.evenflow_kernels.DecodeStack()
        for layer in layers:
            layer.add_to(self.stack)
        # the op's C++ entry itself: torch's Python wrapper for an op that takes a script object
        # walks every argument looking for fake ones (~40 us a step with the cache lists)
        op = torch.ops.evenflow_kernels.decode_stack.default
        self.run = getattr(op, "_op", op)
        step = torch.ops.evenflow_kernels.decode_step.default
        self.run_step = getattr(step, "_op", step)
        self.head: tuple | None = None  # what set_head was given (model, lm_head, cos)

    def set_head(self, model: CausalLM) -> None:
        """The rest of the step too — embedding, rotary rows, final norm, lm_head — where they
        are this stack's dtype and lm_head a panel linear: then `step` makes the logits."""
        lm_head, norm, embed = model.lm_head, model.model.norm, model.model.embed_tokens
        args = panels_args(lm_head)
        if model.tp is not None or args is None or model._cos is None or model._sin is None:
            return
        if not norm.weight.dtype == embed.weight.dtype == model._cos.dtype == self.dtype:
            return
        self.stack.set_head(embed.weight.data, model._cos, model._sin, norm.weight.data,
                            float(norm.eps), list(args[:4]), args[4], model.config.vocab_size)
        self.head = (model, lm_head, model._cos)

    def usable(self) -> bool:
        return all(f.usable() for f in self.layers)

    def head_usable(self) -> bool:
        """set_head's pieces still the model's (its lm_head, rotary tables, no TP since)."""
        if self.head is None:
            return False
        model, lm_head, cos = self.head
        return model._modules["lm_head"] is lm_head and model._cos is cos and model.tp is None

    def serves(self, meta: AttentionMetadata, dtypes: tuple[torch.dtype, ...],
               kv: tuple[Tensor, ...]) -> bool:
        """These (usable) layers take this step: decodes only, on the paged attention, one
        dtype throughout (`dtypes`: the embedding's and rotary tables'; the caches', the
        norms')."""
        cache_ok = kv[0].dtype == self.dtype or (  # or an int8 cache, on its kernels
            len(kv) == 4 and kv[0].dtype == torch.int8 and native.kv_int8() is not None)
        return not meta.prefills and meta.decode_lens is not None and \
            dtypes[0] == dtypes[1] == self.dtype and cache_ok

    def step(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
             meta: AttentionMetadata) -> Tensor:
        """The whole decode step, every row sampled: -> (T, vocab) float32 logits."""
        return self.run_step(
            self.stack, input_ids, positions, [kv[0] for kv in kv_caches],
            [kv[1] for kv in kv_caches], meta.slot_mapping, meta.decode_slots, meta.decode_lens,
            *_scales(kv_caches))

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, kv_caches: list[tuple[Tensor, ...]],
                 meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """-> (the residual stream, the last layer's MoE output not yet added to it)."""
        return self.run(
            self.stack, x, cos, sin, [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches],
            meta.slot_mapping, meta.decode_slots, meta.decode_lens, *_scales(kv_caches))


def _scales(kv_caches: list[tuple[Tensor, ...]]) -> tuple[list[Tensor], list[Tensor], int]:
    """An int8 cache's K and V scales per layer and its block size; none for a float cache."""
    if len(kv_caches[0]) != 4:
        return [], [], 1
    return ([kv[2] for kv in kv_caches], [kv[3] for kv in kv_caches],
            block_size_of(kv_caches[0][0], kv_caches[0][2]))


def panels_args(module: Any) -> tuple | None:
    """panel_linear's arguments after x for this linear (its outputs may be padded to a whole
    panel: the caller keeps the first out_features), or None where it is not one call."""
    if isinstance(module, panels.PanelLinear):
        return module.kernel_args()
    return linear_args(module)


def fast_stack(model: CausalLM) -> FastDecodeStack | None:
    """Every layer's fast decode in one stack (with the step's head where it qualifies), or
    None unless all of the layers do."""
    layers = model.decoder_layers()
    if len(layers) != len(model.model.layers):
        return None
    fast = [FastDecodeLayer.of(layer) for layer in layers]
    if not fast or any(f is None for f in fast):
        return None
    stack = FastDecodeStack([f for f in fast if f is not None])
    stack.set_head(model)
    return stack

