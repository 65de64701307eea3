"""The choice of a quantized weight's stored form: the panel form where the native panel
kernels serve it, else int8 / int4 stacks with their measured kernels, w8a8 on torch's
integer matmul, or MXFP4 / FP8 as stored (dequantized per call). 5-bit codes (GGUF's Q5 types)
have a kernel only in the VNNI panels; elsewhere they are quantized again as int8 per channel."""

from __future__ import annotations

import torch

from evenflow.engine.quant.fp8 import Fp8Stack, Fp8Values
from evenflow.engine.quant.mxfp4 import Mxfp4Stack, Mxfp4Values
from evenflow.engine.quant.panel_stack import PanelStack, usable
from evenflow.engine.quant.stacks import (
    Int4Stack,
    Int8Stack,
    QuantConfig,
    QuantStack,
    QuantValues,
    W8A8Stack,
    quantize,
)


def build_stack(values: list[QuantValues] | list[Mxfp4Values] | list[Fp8Values], dtype: torch.dtype,
                gate_up: bool = False, consume: bool = False) -> QuantStack:
    """The stored form for these weights (all of one shape and method): panels for the native
    panel kernels where they serve (panel_stack.py; `gate_up`: a MoE layer's gate and
    up stack, whose channels the fused kernel takes interleaved), else the int8 / int4 stacks
    (stacks.py). `consume`: the panel form may empty `values` as it goes (the caller is done with
    them)."""
    if usable(values, dtype, gate_up):  # type: ignore[arg-type]
        return PanelStack.build(values, gate_up, consume, dtype)  # type: ignore[arg-type]
    if isinstance(values[0], Mxfp4Values):
        return Mxfp4Stack.build(values)  # type: ignore[arg-type]
    if isinstance(values[0], Fp8Values):
        return Fp8Stack.build(values)  # type: ignore[arg-type]
    if values[0].int8_activations:
        return W8A8Stack.build(values)
    if values[0].bits == 5:  # (5-bit codes have a kernel only in the VNNI panels)
        values = [quantize(v.dequantize(),  # type: ignore[union-attr]
                           QuantConfig("int8")) for v in values]
    if values[0].bits == 8:
        return Int8Stack.build(values, dtype)  # type: ignore[arg-type]
    return Int4Stack.build(values, dtype)
