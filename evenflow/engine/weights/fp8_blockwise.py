"""Reading FP8 block-wise checkpoints (`quant_method: fp8` with `weight_block_size`, as
DeepSeek-V3/R1, Qwen3-FP8 and GLM-4.5-FP8 ship): each quantized linear layer `<name>` stores
`<name>.weight` float8_e4m3fn (N, K) and `<name>.weight_scale_inv` float32 (ceil(N/128),
ceil(K/128)). They are kept as FP8 (engine/quant/fp8.py), never expanded to bf16: one byte a
weight plus a float32 scale per output channel and block of 128 inputs.

Activations are not quantized (`activation_scheme` dynamic or static alike): the matmul runs in
the engine's dtype on the exact weights, which is more precise than an fp8 x fp8 product and is
how a CPU without fp8 arithmetic runs these checkpoints. Static input scales are dropped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from evenflow.engine.config.settings import ModelLoadError
from evenflow.engine.quant.fp8 import BLOCK, Fp8Values, expand_block_scales
from evenflow.engine.weights.quantized_copy import write_quantized_copy

FORMAT = "fp8"
# Layers the engine keeps in its own dtype (engine/weights/quantize_model.py: MLA's kv_b_proj is
# read per head by the absorbed decode): dequantized as read.
KEPT_PLAIN = ("kv_b_proj",)


def read_quant_config(spec: dict[str, Any]) -> dict[str, Any]:
    """Our summary of an fp8 quantization_config: {"format": "fp8", "bits": 8}; ModelLoadError
    for the variants we cannot serve."""
    fmt = spec.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelLoadError(f"FP8 checkpoints in {fmt!r} are not supported (e4m3 is)")
    block = spec.get("weight_block_size")
    if block != [BLOCK, BLOCK]:
        raise ModelLoadError(f"FP8 checkpoints with weight_block_size {block} are not supported "
                             f"(block-wise [{BLOCK}, {BLOCK}] is; per-tensor FP8 is not)")
    return {"format": FORMAT, "bits": 8}


def take_quantized(tensors: dict[str, Tensor], spec: dict[str, Any]) -> dict[str, Fp8Values]:
    """Pop every FP8 layer out of `tensors`: Fp8Values by HF layer name (no `.weight`); the
    layers kept plain go back into `tensors` dequantized (float32)."""
    del spec
    values: dict[str, Fp8Values] = {}
    for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
        base = name.removesuffix(".weight_scale_inv")
        scale_inv = tensors.pop(name)
        q = tensors.pop(f"{base}.weight", None)
        if q is None:
            raise ModelLoadError(f"FP8 checkpoint has {name} but not {base}.weight")
        n, k = q.shape
        if tuple(scale_inv.shape) != (-(-n // BLOCK), -(-k // BLOCK)):
            raise ModelLoadError(f"{name}: scales {tuple(scale_inv.shape)} do not tile "
                                 f"{base}.weight {tuple(q.shape)} by {BLOCK}")
        try:
            value = Fp8Values(q, expand_block_scales(scale_inv, n))
        except ValueError as exc:
            raise ModelLoadError(f"{base}: {exc}") from exc
        if base.endswith(KEPT_PLAIN):
            tensors[f"{base}.weight"] = value.dequantize()
        else:
            values[base] = value
    for name in [n for n in tensors if n.endswith((".input_scale", ".activation_scale"))]:
        del tensors[name]
    return values


def quantize_tiles(weight: Tensor) -> dict[str, Tensor]:
    """One weight (N, K) as an FP8 checkpoint stores it: float8_e4m3fn values and a float32
    `weight_scale_inv` per 128 x 128 tile (its largest magnitude / 448, e4m3's largest)."""
    n, k = weight.shape
    w = weight.float()
    padded = torch.nn.functional.pad(w, (0, -k % BLOCK, 0, -n % BLOCK))
    tiles = padded.view(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)
    scale = (tiles.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)  # (N/128, K/128)
    per = scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    return {"weight": (w / per).to(torch.float8_e4m3fn), "weight_scale_inv": scale}


def write_fp8(source: str | Path, out: str | Path) -> Path:
    """An FP8 block-wise copy of an unquantized checkpoint (as DeepSeek ships V3): every
    quantizable linear in e4m3 with 128 x 128 tile scales (for benchmarks and tools)."""

    def convert(base: str, weight: Tensor) -> dict[str, Tensor]:
        return {f"{base}.{name}": t for name, t in quantize_tiles(weight).items()}

    return write_quantized_copy(
        source, out, lambda shape: True, convert,
        {"quant_method": FORMAT, "fmt": "e4m3", "activation_scheme": "dynamic",
         "weight_block_size": [BLOCK, BLOCK]})
