"""Weights in the panel layout of the native panel kernels (engine/kernels/panel.h): the fused
routed-experts kernel (kernels/fused_moe.cpp) and the dense panel linear (panel_linear.cpp).

A weight (N, K) is cut into panels of 64 output channels with the inputs outermost inside a
panel: (N/64, K/2, 64, 2) in bfloat16 (input pairs side by side for vdpbf16ps), (N/64, K, 64) in
float32. A gate_up weight (2I, K) first has its channels interleaved so that panel p holds gate
channels [32p, 32p + 32) and then up channels [32p, 32p + 32): one panel gives 32 activations.
Packing is a reorder, so the fused kernel reads the same values the checkpoint holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from evenflow.engine.kernels import native

PANEL = 64


def _dtype_served(dtype: torch.dtype) -> bool:
    """float32 on AVX-512 and AVX2 builds (each with its own register blocking:
    kernels/panel.h), bf16 only with AVX512-BF16's dot product."""
    if dtype == torch.float32:
        return native.panels_f32_fast()
    return dtype == torch.bfloat16 and native.built_for_avx512() and \
        bool(torch.ops.evenflow_kernels.fused_moe_bf16_supported())


def usable(dtype: torch.dtype, hidden: int, intermediate: int) -> bool:
    """The fused MoE kernel is built, switched on and takes this dtype and these sizes here."""
    if native.fused_moe() is None or hidden % PANEL or intermediate % PANEL:
        return False
    return _dtype_served(dtype)


def linear_usable(dtype: torch.dtype, out_features: int, in_features: int,
                  padded: bool = False) -> bool:
    """The panel linear is built, switched on and takes this dtype and this shape here
    (`padded`: outputs beyond a multiple of 64 are computed on zero rows and dropped)."""
    if native.panel_linear() is None or (out_features % PANEL and not padded) or in_features % 2:
        return False
    return _dtype_served(dtype)


def pack_weight(weight: Tensor, gate_up: bool = False) -> Tensor:
    """weight (N, K) in the panel layout (a new contiguous tensor, same dtype)."""
    n, k = weight.shape
    if gate_up:  # panel p: gate [32p, 32p + 32), then up [32p, 32p + 32)
        gate, up = weight.view(2, n // PANEL, PANEL // 2, k).unbind(0)
        weight = torch.stack([gate, up], dim=1).reshape(n, k)
    if weight.dtype == torch.bfloat16:
        return weight.reshape(n // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return weight.reshape(n // PANEL, PANEL, k).permute(0, 2, 1).contiguous()


def unpack_weight(packed: Tensor, gate_up: bool = False) -> Tensor:
    """The plain (N, K) weight back from its panel layout."""
    if packed.dtype == torch.bfloat16:
        panels, half_k, _, _ = packed.shape
        weight = packed.permute(0, 2, 1, 3).reshape(panels * PANEL, half_k * 2)
    else:
        panels, k, _ = packed.shape
        weight = packed.permute(0, 2, 1).reshape(panels * PANEL, k)
    if gate_up:
        n, k = weight.shape
        interleaved = weight.view(n // PANEL, 2, PANEL // 2, k)
        weight = torch.cat([interleaved[:, 0].reshape(n // 2, k),
                            interleaved[:, 1].reshape(n // 2, k)])
    return weight


def group_word(group: int, dequant_from: int = 0, dequant_from2: int = 0) -> int:
    """The panel ops' `group` argument (kernels/panel_quant.h GroupWord): the quantization
    group, with the kernel plans' thresholds — from how many rows a panel is dequantized first
    (0: the kernels' own) — for the weight (fused_moe: its gate_up; dequant_from2: its down)."""
    assert 0 <= group < 2**32 and 0 <= dequant_from < 2**16 and 0 <= dequant_from2 < 2**15
    return group | dequant_from << 32 | dequant_from2 << 48


# The experts' activations the fused kernel computes (kernels/fused_moe.cpp Activation)
ACTIVATIONS = {"silu": 0, "clamped_swiglu": 1}


def run_experts(x: Tensor, slots: Tensor, route_weights: Tensor, w13: list[Tensor],
                w2: list[Tensor], scales13: list[Tensor] | tuple = (),
                scales2: list[Tensor] | tuple = (), offsets13: list[Tensor] | tuple = (),
                offsets2: list[Tensor] | tuple = (), group: int = 0, *,
                b13: Tensor | None = None, b2: Tensor | None = None, activation: str = "silu",
                alpha: float = 1.0, limit: float = 0.0) -> Tensor:
    """x (T, H) through its top-k slots (T, k) with weights (T, k): the routed experts' sum.
    Plain weights in x's dtype, or quantized ones (engine/quant/panel_stack.py) with their scales
    (and int4 offsets). b13 (slots, 2I) [gate | up] and b2 (slots, H): the slots' biases, float32;
    activation: silu (silu(gate) * up) or clamped_swiglu (GPT-OSS's, with alpha and limit)."""
    if route_weights.dtype != torch.float32:  # (route_topk's are already: no cast a layer)
        route_weights = route_weights.float()
    return torch.ops.evenflow_kernels.fused_moe(
        x.contiguous(), slots.contiguous(), route_weights.contiguous(), w13, w2,
        list(scales13), list(scales2), list(offsets13), list(offsets2), group, b13, b2,
        ACTIVATIONS[activation], alpha, limit)


class PanelLinear(nn.Module):
    """nn.Linear with its weight in the panel layout, run by kernels/panel_linear.cpp (the
    plain copy is dropped). Outputs are padded to a whole panel with zero rows where needed
    (a MoE router's 8 experts: reading 64 rows costs less than oneDNN's ~40 µs call)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, bias = linear.weight.data, linear.bias
        pad = -self.out_features % PANEL
        if pad:
            weight = torch.cat([weight, weight.new_zeros(pad, self.in_features)])
        self.packed: Tensor
        self.register_buffer("packed", pack_weight(weight), persistent=False)
        self.bias = bias
        self._bias = None if bias is None else F.pad(bias.data.float(), (0, pad)).contiguous()

    def kernel_args(self) -> tuple:
        """panel_linear's arguments after x (the weight, bias, scale, offset, group)."""
        return (self.packed, self._bias, None, None, 0)

    def padded(self, x: Tensor) -> Tensor:
        """x (T, in) -> (T, a whole number of panels): the zero rows' outputs included."""
        return torch.ops.evenflow_kernels.panel_linear(x.contiguous(), *self.kernel_args())

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        out = torch.ops.evenflow_kernels.panel_linear(flat, *self.kernel_args())
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features].contiguous()
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, panels"
