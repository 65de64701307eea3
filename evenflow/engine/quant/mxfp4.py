"""MXFP4 as a stored form: the format GPT-OSS checkpoints ship their experts in (OCP microscaling
FP4), kept at its 4.25 bits a weight in memory.

The format: each run of 32 weights along the input dimension shares one power-of-two scale (E8M0:
a biased exponent byte, 127 = 2^0), and each weight is a 4-bit E2M1 float (one of +-{0, 0.5, 1,
1.5, 2, 3, 4, 6}), two to a byte, the lower nibble first. A checkpoint stores `<proj>_blocks`
(..., out, in / 32, 16) uint8 and `<proj>_scales` (..., out, in / 32) uint8.

- `Mxfp4Values`: one weight (N, K) as the checkpoint ships it (the loader's hand-over, like
  `QuantValues` for the integer forms).
- `Mxfp4Stack`: the torch fallback (E weights as stored; a call dequantizes the expert it needs).
  Where the native panel kernels serve (AVX-512 VNNI), `quant.build_stack` makes a `PanelStack`
  instead: the same codes and exponent bytes in the W4A8 layout, read by vpdpbusd through a code
  lookup for few rows and dequantized a panel at a time for more (engine/kernels/panel_w8a8.h).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from evenflow.engine.quant.stacks import StoredStack

GROUP = 32  # weights per scale
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def codes(blocks: Tensor) -> Tensor:
    """(..., G, 16) packed nibbles -> (..., G * 32) uint8 codes 0..15, input order."""
    packed = blocks.to(torch.uint8)
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-3)


def dequantize(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(..., out, in / 32, 16) nibbles and (..., out, in / 32) exponents -> (..., out, in) in
    `dtype` (exact: every MXFP4 value is a float32 one; in bf16 too, an E2M1 value times a
    power of two)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                         f"{tuple(scales.shape)}")
    lut = torch.tensor(E2M1, dtype=torch.float32)
    values = lut[codes(blocks).long()].unflatten(-1, (-1, GROUP))  # (..., out, G, 32)
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2).to(dtype)


def quantize(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(..., out, in) -> (blocks, scales) as checkpoints store them (for tools and benchmarks
    that make MXFP4 checkpoints): per group of 32 the smallest power of two that brings its
    largest magnitude within 6, each weight rounded to the nearest E2M1 value."""
    *lead, in_features = weight.shape
    if in_features % GROUP:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of {GROUP}")
    groups = weight.float().reshape(*lead, in_features // GROUP, GROUP)
    amax = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = groups / torch.pow(2.0, exponent).unsqueeze(-1)
    magnitudes = torch.tensor(E2M1[:8])
    nearest = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(-1)  # 0..7
    code = (nearest + 8 * (scaled < 0)).to(torch.uint8)
    pairs = code.view(*code.shape[:-1], GROUP // 2, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.contiguous(), (exponent + SCALE_BIAS).to(torch.uint8)


@dataclass
class Mxfp4Values:
    """One weight (N, K) in MXFP4 as stored: blocks (N, K/32, 16) uint8, scales (N, K/32)
    uint8."""

    blocks: Tensor
    scales: Tensor
    bits = 4
    group_size = GROUP
    int8_activations = False

    def __post_init__(self) -> None:
        if self.blocks.shape[:-1] != self.scales.shape or self.blocks.shape[-1] != GROUP // 2 \
                or self.blocks.dim() != 3:
            raise ValueError(f"MXFP4 blocks {tuple(self.blocks.shape)} do not match scales "
                             f"{tuple(self.scales.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        n, groups, _ = self.blocks.shape
        return n, groups * GROUP

    def codes(self) -> Tensor:
        """(N, K) uint8 E2M1 codes, input order."""
        return codes(self.blocks)

    def dequantize(self) -> Tensor:
        return dequantize(self.blocks, self.scales)


class Mxfp4Stack(StoredStack):
    """E weights in MXFP4 as stored (blocks (E, N, K/32, 16), scales (E, N, K/32)); a call
    dequantizes its expert's weight and runs the dense matmul (the fallback where the panel
    kernels do not serve: no AVX-512 VNNI, or EVENFLOW_NATIVE_W4A8=0)."""

    bits = 4
    group_size = GROUP

    def __init__(self, blocks: Tensor, scales: Tensor) -> None:
        super().__init__(blocks, scales, blocks.shape[2] * GROUP)

    @classmethod
    def build(cls, values: list[Mxfp4Values]) -> StoredStack:
        return cls.stacked([(v.blocks, v.scales) for v in values])

    def dequantize(self, e: int, dtype: torch.dtype) -> Tensor:
        return dequantize(self.values[e], self.scales[e], dtype)
