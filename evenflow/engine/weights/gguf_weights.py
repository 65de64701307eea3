"""GGUF's quantized blocks, as a converted GGUF directory holds them (`<name>.gguf_<type>` uint8
(rows, bytes a row): models/gguf_import.py), into the engine's stored forms as each layer loads.

The choice per type (bytes held against the file's: int4 g32 5 bits a weight, int5 6, int8 8):
- Q4_0, Q4_1 and Q4_K: int4 in groups of 32 (w = q * scale + offset: exactly the file's values;
  in the W4A8 panels the scale and offset are float16, a rounding far below the format's own
  step). 1.1x Q4_K's bytes.
- Q5_0, Q5_1 and Q5_K: where the W4A8 panels serve (AVX-512 VNNI), 5-bit codes in groups of 32,
  the file's values as int4's are (engine/quant/panel_stack.py's int5): 1.09x Q5_K's bytes.
  Elsewhere, as Q6_K.
- Q6_K and Q8_0: int8 per output channel, quantized again from the file's exact values. The
  engine has no 6-bit kernel; int8's step (the row's largest value / 127) sits well below the
  K-quants' own steps, so the requantization adds little to the file's own error
  (tests/engine/test_gguf.py measures it on random weights against the original values). Q6_K
  1.22x, Q8_0 0.94x (the 5-bit types as int8: 1.45x).
A fused group (q/k/v, or an expert's gate and up) whose parts differ in type (Q4_K_M keeps V in
Q6_K) is quantized again as one int8 weight, except 4- and 5-bit parts, which join as 5-bit
codes exactly (engine/weights/gptq.py `_concat`). A group whose
parts are partly not quantized at all (llama-quantize leaves rows that are not whole blocks in
float: a small model's experts) is dequantized whole, as the engine fuses or stacks it.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from evenflow.engine.config.settings import ModelLoadError
from evenflow.engine.quant.stacks import QuantConfig, QuantValues, quantize
from evenflow.engine.weights.hf_names import EXPERT
from evenflow.models import gguf_blocks

FORMAT = "gguf"
_BLOCKS = re.compile(r"^(.+)\.gguf_(" + "|".join(gguf_blocks.NAMES.values()) + r")$")
_KIND = {name: kind for kind, name in gguf_blocks.NAMES.items()}
_INT8 = QuantConfig("int8")
_QKV = re.compile(r"^(model\.layers\.\d+)\.self_attn\.[qkv]_proj$")
# (a group of 32 whose scale is 0, all of one value: its offset survives w = (q - zero) * scale
# only with a scale that is not 0)
_TINY_SCALE = 1e-30


def read_quant_config(spec: dict[str, Any]) -> dict[str, Any]:
    del spec
    return {"format": FORMAT, "bits": 4}


def to_values(kind: int, raw: Tensor) -> QuantValues:
    """One linear's blocks (rows, bytes a row) in the engine's form (the module docstring)."""
    codes = gguf_blocks.decode_rows(kind, raw.numpy())
    if gguf_blocks.BITS[kind] in (4, 5):
        scale = torch.from_numpy(codes.scale)  # (Q4_0's may be negative)
        scale = torch.where(scale == 0, torch.full_like(scale, _TINY_SCALE), scale)
        zero = -torch.from_numpy(codes.offset) / scale
        return QuantValues(gguf_blocks.BITS[kind], torch.from_numpy(codes.q), scale, zero)
    return quantize(torch.from_numpy(codes.dequantize()), _INT8)


def _group(base: str) -> tuple[str, str] | None:
    """The fused or stacked group a linear belongs to: (layer prefix, "qkv" / "experts")."""
    if m := EXPERT.match(base):
        return m[1], "experts"
    if m := _QKV.match(base):
        return m[1], "qkv"
    return None


def take_quantized(tensors: dict[str, Tensor], spec: dict[str, Any]) -> dict[str, QuantValues]:
    """Pop every block tensor out of `tensors`: QuantValues by HF layer name (no `.weight`);
    the members of a group that is partly plain go back into `tensors` dequantized."""
    del spec
    plain_groups = {_group(n.removesuffix(".weight")) for n in tensors if n.endswith(".weight")}
    plain_groups.discard(None)
    values: dict[str, QuantValues] = {}
    for name in [n for n in tensors if _BLOCKS.match(n)]:
        m = _BLOCKS.match(name)
        assert m is not None
        try:
            kind, raw = _KIND[m[2]], tensors.pop(name)
            if _group(m[1]) in plain_groups:
                codes = gguf_blocks.decode_rows(kind, raw.numpy())
                tensors[f"{m[1]}.weight"] = torch.from_numpy(codes.dequantize())
            else:
                values[m[1]] = to_values(kind, raw)
        except ValueError as exc:
            raise ModelLoadError(f"{name}: {exc}") from exc
    return values
