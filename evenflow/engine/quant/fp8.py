"""FP8 block-wise as a stored form: the format DeepSeek-V3/R1, Qwen3 and GLM ship their FP8
checkpoints in (`quant_method: fp8`, `weight_block_size: [128, 128]`), kept at its byte a weight.

The format: each weight is a float8_e4m3fn (sign, 4 exponent bits biased by 7, 3 mantissa bits;
no infinities, largest 448), and each tile of 128 x 128 weights has one float32 `weight_scale_inv`
by which its values are multiplied: w[n, k] = fp8[n, k] * scale_inv[n // 128, k // 128].

In memory we keep the fp8 bytes as they are and the scale per (output channel, block of 128
inputs): (N, ceil(K / 128)) float32, 0.25 bits a weight more than the file, so that fused q/k/v
and gate/up (whose parts need not start on a tile boundary) are a row concatenation.

- `Fp8Values`: one weight (N, K) as stored (the loader's hand-over).
- `Fp8Stack`: the torch fallback: a call dequantizes its weight exactly (every e4m3 value times
  its float32 scale is a float32 product) and runs the dense matmul. Where the native panel
  kernels serve, `quant.build_stack` makes a `PanelStack` of the same bytes instead
  (engine/kernels/panel_fp8.h: the fp8 panels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from evenflow.engine.quant.stacks import StoredStack

BLOCK = 128  # inputs (and, in the file, outputs) a scale covers


def expand_block_scales(scale_inv: Tensor, n: int) -> Tensor:
    """A checkpoint's (ceil(N/128), ceil(K/128)) tile scales -> (N, ceil(K/128)) per row."""
    return scale_inv.float().repeat_interleave(BLOCK, dim=0)[:n].contiguous()


@dataclass
class Fp8Values:
    """One weight (N, K): q float8_e4m3fn, scale (N, ceil(K/128)) float32."""

    q: Tensor
    scale: Tensor
    bits = 8
    group_size = BLOCK
    int8_activations = False

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.q.dtype != torch.float8_e4m3fn or self.scale.shape != (n, -(-k // BLOCK)):
            raise ValueError(f"FP8 weight {tuple(self.q.shape)} {self.q.dtype} does not match "
                             f"its scales {tuple(self.scale.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.q.shape
        return n, k

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize(self.q, self.scale, dtype)

    @staticmethod
    def concat(parts: list[Fp8Values]) -> Fp8Values:
        """Stacked along N (fused q/k/v, gate/up)."""
        return Fp8Values(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))


def dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(N, K) e4m3 and (N, ceil(K/128)) scales -> (N, K) in `dtype` (computed in float32)."""
    k = q.shape[-1]
    per_input = scale.repeat_interleave(BLOCK, dim=-1)[..., :k]
    return (q.float() * per_input).to(dtype)


class Fp8Stack(StoredStack):
    """E weights in FP8 as stored: values (E, N, K) float8_e4m3fn, scales (E, N, ceil(K/128))."""

    bits = 8
    group_size = BLOCK

    def __init__(self, q: Tensor, scale: Tensor) -> None:
        super().__init__(q, scale, q.shape[2])

    @classmethod
    def build(cls, values: list[Fp8Values]) -> StoredStack:
        return cls.stacked([(v.q, v.scale) for v in values])

    def dequantize(self, e: int, dtype: torch.dtype) -> Tensor:
        return dequantize(self.values[e], self.scales[e], dtype)
