"""What the W4A8 kernel does to its rows, in torch: each group of `group` inputs quantized to
int8 by its own scale (max |x| / 127, round to nearest even) and back, so a test can hold the
kernel to the dequantized weight times these rows at the dtype's own tolerance."""

from __future__ import annotations

import torch

from evenflow.engine.quant.panel_stack import PanelStack, w4a8_layout

W4A8_MAX_ROWS = 16  # kernels/panel_quant.h kDequantRowsW4A8: from here a dequantized panel


def int8_rows_below(stack: PanelStack) -> int:
    """Rows below this count meet the stack's codes as int8 rows (w8a8 and int8 in its layout:
    per row; int4 / 5-bit codes in the VNNI layout: per group); from it on, a dequantized
    panel meets the rows as they are. The stack's kernel plan where it has one, else the
    kernels' built-in thresholds (panel_quant.h dequant_rows)."""
    if stack.form not in ("w8a8", "int8 rows", "int4 vnni", "int5", "mxfp4"):
        return 0
    if stack.dequant_from:
        return stack.dequant_from
    return 2**62 if stack.form in ("w8a8", "int8 rows") else W4A8_MAX_ROWS


def w4a8_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """x (..., K) as the W4A8 kernel sees it, in float32."""
    xf = x.float()
    grouped = xf.reshape(*xf.shape[:-1], -1, group)
    peak = grouped.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(peak > 0, 127.0 / peak, torch.zeros_like(peak))
    q = torch.round(grouped * inv)
    return (q * (peak / 127.0)).reshape(xf.shape)


def seen_rows(stack: object, x: torch.Tensor) -> torch.Tensor:
    """The rows as a panel stack's kernel multiplies them: int8-quantized (per row for w8a8
    and int8 rows, per group for W4A8) when x has fewer rows than int8_rows_below, else x in
    float32."""
    if isinstance(stack, PanelStack) and x.shape[0] < int8_rows_below(stack):
        if stack.form in ("w8a8", "int8 rows"):
            return w4a8_rows(x, x.shape[-1])
        if stack.bits in (4, 5) and w4a8_layout(stack.group_size, stack.in_features):
            return w4a8_rows(x, stack.group_size)
    return x.float()


def seen_weight(stack: object, values) -> torch.Tensor:
    """The weight as a panel stack's kernel holds it (float32): int4 (and 5-bit codes) in the
    VNNI layout keep their scale and offset (-zero * scale) in float16; MXFP4 is exact either
    way."""
    if not hasattr(values, "zero"):  # MXFP4, FP8 (engine/quant/mxfp4.py, fp8.py)
        return values.dequantize()
    if not (isinstance(stack, PanelStack) and stack.bits in (4, 5) and
            w4a8_layout(stack.group_size, stack.in_features)):
        return values.dequantize()
    g = values.group_size
    q = values.q.float().view(values.q.shape[0], -1, g)
    zero = values.zero if values.zero is not None else torch.full_like(values.scale, 8.0)
    scale = values.scale.float()
    s, o = scale.half().float(), (-zero * scale).half().float()
    return (q * s.unsqueeze(-1) + o.unsqueeze(-1)).view(values.q.shape)
