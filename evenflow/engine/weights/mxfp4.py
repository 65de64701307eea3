"""MXFP4, the format GPT-OSS checkpoints ship their experts in (OCP microscaling FP4): each run
of 32 weights along the input dimension shares one power-of-two scale (E8M0: a biased exponent
byte, 127 = 2^0), and each weight is a 4-bit E2M1 float (one of +-{0, 0.5, 1, 1.5, 2, 3, 4,
6}), two to a byte, the lower nibble first.

A checkpoint stores `<proj>_blocks` (..., out, in / 32, 16) uint8 and `<proj>_scales`
(..., out, in / 32) uint8. The engine dequantizes them as it loads (engine/weights/loader.py),
into its own dtype (or, with --quantization, into int8 / int4 after that): there is no native
MXFP4 kernel yet. `quantize` writes the format, for tests and tools.
"""

from __future__ import annotations

import torch
from torch import Tensor

GROUP = 32  # weights per scale
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize(blocks: Tensor, scales: Tensor) -> Tensor:
    """(..., out, in / 32, 16) nibbles and (..., out, in / 32) exponents -> (..., out, in)
    float32."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                         f"{tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    packed = blocks.to(torch.uint8)
    values = torch.stack([lut[(packed & 0x0F).long()], lut[(packed >> 4).long()]], dim=-1)
    values = values.flatten(-2)  # (..., out, groups, 32)
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2)


def quantize(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(..., out, in) -> (blocks, scales) as checkpoints store them: per group of 32 the
    smallest power of two that brings its largest magnitude within 6, each weight rounded to
    the nearest E2M1 value."""
    *lead, in_features = weight.shape
    if in_features % GROUP:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of {GROUP}")
    groups = weight.float().reshape(*lead, in_features // GROUP, GROUP)
    amax = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = groups / torch.pow(2.0, exponent).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES[:8])
    nearest = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(-1)  # magnitude's code, 0..7
    codes = (nearest + 8 * (scaled < 0)).to(torch.uint8)
    pairs = codes.view(*codes.shape[:-1], GROUP // 2, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.contiguous(), (exponent + SCALE_BIAS).to(torch.uint8)
