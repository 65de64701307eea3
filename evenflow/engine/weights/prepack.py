"""Weights reordered once into oneDNN's blocked layout, so each matmul streams them as fast as
memory allows.

A decode step is a series of skinny matmuls (a few rows times a whole weight): bound by reading
the weight. `F.linear` over a plain row-major bf16 weight reads it at about half the speed oneDNN
reaches with a weight reordered for its kernel (measured here: 1.8-2.3x at 1-2 rows, 1.2x at 32,
~1.03x at 512; bitwise the same result). So after loading, every dense linear layer becomes a
`PackedLinear` and each MoE layer's expert stacks become per-expert packed weights, run by the
per-expert loop (which then beats the padded batched matmul at decode too) — unless the engine's
own panel kernels serve (engine/kernels/panels.py: bf16 with AVX512-BF16, or fp32): then dense
layers become `PanelLinear` (no per-call start-up) and expert stacks go to the fused MoE kernel's
layout.

Only plain (unquantized) float weights are packed, and only where torch has oneDNN; quantized
layers keep their own kernels. `prepack_weights=False` in EngineConfig turns this off.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from evenflow.engine.kernels import panels
from evenflow.engine.model.experts import FusedExperts, PackedExperts
from evenflow.engine.model.moe import MoE
from evenflow.engine.model.transformer import CausalLM


def available(dtype: torch.dtype) -> bool:
    """oneDNN can pack this dtype here (bf16 needs the CPU's bf16 support, which an AVX2
    machine, or ONEDNN_MAX_CPU_ISA=AVX2, lacks: then the weights stay plain)."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    try:
        pack(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True


def pack(weight: Tensor) -> Tensor:
    """weight (out, in) reordered for oneDNN's linear."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)


def packed_linear(x: Tensor, packed: Tensor, bias: Tensor | None = None) -> Tensor:
    if x.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


class PackedLinear(nn.Module):
    """nn.Linear with its weight packed (the plain copy is dropped)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed: Tensor
        self.register_buffer("packed", pack(linear.weight.data), persistent=False)
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        return packed_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, packed"


def prepack_model(model: CausalLM, dtype: torch.dtype, fuse_experts: bool = True) -> None:
    """Pack every plain float linear layer and MoE expert stack of `model` (in place). A tied
    lm_head stays as it is (packing would copy the embedding). Expert stacks go to the fused
    kernel's layout where it serves (`fuse_experts`: not on expert-parallel ranks, whose
    experts run per expert between two all-to-alls), to oneDNN's otherwise."""
    for module in model.modules():
        if fuse_experts and isinstance(module, MoE) and _fusable(module, dtype):
            module.store(FusedExperts(
                [panels.pack_weight(w, gate_up=True) for w in module.w13.data],
                [panels.pack_weight(w) for w in module.w2.data]))
    if not available(dtype):
        return
    tied = model.config.tie_word_embeddings
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child.weight.dtype == dtype and child.weight.numel():
                if child is model.lm_head and tied:
                    continue
                fast = panels.linear_usable(dtype, child.out_features, child.in_features,
                                            padded=True)
                setattr(module, name, panels.PanelLinear(child) if fast else PackedLinear(child))
        # (experts with biases or another activation stay plain stacks: decode runs them all
        # in one padded bmm with the biases, where a per-expert loop of packed weights would
        # cost ~12 small ops an expert)
        if isinstance(module, MoE) and module.stored is None and module.w13.numel() and \
                module.plain_experts:
            module.store(PackedExperts([pack(w) for w in module.w13.data],
                                       [pack(w) for w in module.w2.data]))


def _fusable(moe: MoE, dtype: torch.dtype) -> bool:
    """Float experts of this dtype whose activation the fused kernel computes (biases and
    GPT-OSS's clamped SwiGLU included), sizes it takes (a tensor-parallel shard's own
    intermediate size)."""
    w13 = moe.w13
    return (moe.stored is None and w13.numel() > 0 and w13.dtype == dtype
            and moe.fused_epilogue is not None
            and panels.usable(dtype, w13.shape[2], w13.shape[1] // 2))
