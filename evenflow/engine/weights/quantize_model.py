"""Putting quantized weights into the model: which weights are quantized, and the module that
runs them.

Quantized: the attention projections (fused qkv, o; MLA's q, latent and o projections), dense
and shared-expert MLPs, and the routed experts (w13, w2 stacks). Unquantized: the embedding,
norms, the router (`gate`, tiny and precision-sensitive), MLA's kv_b_proj (read per head by the
absorbed decode) and lm_head unless `quantize_lm_head`. A weight whose shape the method cannot
take (int4 needs K divisible by the group size) stays in the engine's dtype.

The loader calls `quantize_layer` right after filling one decoder layer, so a bf16 copy of the
whole model never exists (peak memory stays near the quantized size). Pre-quantized checkpoints
(engine/weights/gptq.py) hand over `QuantValues` for the weights they carry, which are used as they
are instead of quantizing again.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from evenflow.engine.model.attention import Attention
from evenflow.engine.model.experts import QuantizedExperts
from evenflow.engine.model.mlp import MLP
from evenflow.engine.model.moe import MoE
from evenflow.engine.model.transformer import CausalLM, DecoderLayer
from evenflow.engine.quant.forms import build_stack
from evenflow.engine.quant.stacks import QuantConfig, QuantStack, QuantValues, quantize


class QuantLinear(nn.Module):
    """y = x @ w.T (+ bias) with w quantized."""

    def __init__(self, weight: QuantStack, bias: Tensor | None) -> None:
        super().__init__()
        self.weight_q = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: Tensor) -> Tensor:
        y = self.weight_q.linear(x)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, int{self.weight_q.bits}"


# Names (relative to a decoder layer) of the quantizable linear layers, by module kind.
_ATTENTION = ("self_attn.qkv_proj", "self_attn.o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
# MLA's (kv_b_proj stays in the engine's dtype: decode reads it per head, the absorbed form)
_LATENT = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")


def quantize_layer(layer: DecoderLayer, config: QuantConfig | None, dtype: torch.dtype,
                   given: dict[str, list[QuantValues]] | None = None, index: int = 0) -> None:
    """Replace this layer's quantizable weights (in place). `given`: pre-quantized values by
    name relative to the layer (`self_attn.qkv_proj`, `mlp.w13` as one entry per expert; MXFP4
    experts as Mxfp4Values). config None: only `given` is used (the rest stays as loaded).
    `index`: the layer's, for config.skip's names (`model.layers.<index>.self_attn.o_proj`)."""
    given = given or {}
    attn = layer.self_attn
    names = list(_ATTENTION) if isinstance(attn, Attention) else [
        f"self_attn.{n}" for n in _LATENT if hasattr(attn, n) and getattr(attn, n) is not None]
    mlp = layer.mlp
    if isinstance(mlp, MLP):
        names += [f"mlp.{n}" for n in _MLP]
    elif isinstance(mlp, MoE) and mlp.shared_expert is not None:
        names += [f"mlp.shared_expert.{n}" for n in _MLP]
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = layer.get_submodule(parent_name)
        linear = getattr(parent, attr)
        values = given.get(name)
        own = config.for_module(name) if config is not None else None
        if values is None and own is not None and isinstance(linear, nn.Linear) and \
                own.fits(linear.weight.shape) and own.takes(f"model.layers.{index}.{name}"):
            values = [quantize(linear.weight.data, own)]
        if values is not None:
            setattr(parent, attr, QuantLinear(build_stack(values, dtype), linear.bias))
    if isinstance(mlp, MoE):
        _quantize_experts(mlp, config if config is None or config.takes(
            f"model.layers.{index}.mlp.experts") else None, dtype, given)


def _quantize_experts(moe: MoE, config: QuantConfig | None, dtype: torch.dtype,
                      given: dict[str, list[QuantValues]]) -> None:
    w13 = given.get("mlp.w13")
    w2 = given.get("mlp.w2")
    if w13 is None and config is not None and config.fits(moe.w13.shape) and \
            config.fits(moe.w2.shape):
        w13 = [quantize(w, config) for w in moe.w13.data]
        w2 = [quantize(w, config) for w in moe.w2.data]
    if w13 is None or w2 is None:
        return
    # (the values are this function's or the loader's, handed over: consumed as packed)
    moe.store(QuantizedExperts(build_stack(w13, dtype, gate_up=True, consume=True),
                               build_stack(w2, dtype, consume=True)))


def quantize_head(model: CausalLM, config: QuantConfig | None, dtype: torch.dtype,
                  given: QuantValues | None = None) -> None:
    """lm_head, only when asked (or pre-quantized): it decides every token."""
    head = model.lm_head
    if given is None and config is not None and config.quantize_lm_head and \
            config.takes("lm_head") and \
            isinstance(head, nn.Linear) and not model.config.tie_word_embeddings and \
            config.fits(head.weight.shape):
        given = quantize(head.weight.data, config)
    if given is not None:
        model.lm_head = QuantLinear(build_stack([given], dtype), None)  # type: ignore[assignment]


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of every weight, quantized ones at their stored size, packed ones
    (engine/weights/prepack.py) included (for reports)."""
    total = sum(t.nbytes for t in model.state_dict().values())
    total += sum(t.nbytes for name, t in model.named_buffers() if name.endswith(".packed"))
    for module in model.modules():
        if isinstance(module, QuantLinear):
            total += module.weight_q.nbytes()
        elif isinstance(module, MoE) and module.stored is not None:
            total += module.stored.nbytes()
    return total

