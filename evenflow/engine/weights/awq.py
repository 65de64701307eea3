"""Reading AWQ checkpoints (`quant_method: awq`, as AutoAWQ and llm-compressor write them, GEMM
version): 4-bit weights with a zero point and a scale per group of inputs, loaded into the
engine's int4 (the same kernels as GPTQ's, W4A8 included) with exactly the file's values.

Per quantized linear `<name>`:
- `<name>.qweight` int32 (K, N / 8): eight output channels a word, channel 8j + ORDER[i] in
  nibble i (AWQ's interleaved order, [0, 2, 4, 6, 1, 3, 5, 7]);
- `<name>.qzeros` int32 (K / group, N / 8), packed the same way (as stored, no offset);
- `<name>.scales` float16 (K / group, N);
- w[n, k] = scales[g, n] * (q[k, n] - zero[g, n]), g = k // group.
Without `zero_point` the zeros are 8 (symmetric). Other versions (GEMV, Marlin, exllama
layouts) and other bit widths are refused with a clear error.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from evenflow.engine.config.settings import INT4_GROUP_SIZES, ModelLoadError
from evenflow.engine.quant.stacks import QuantValues

FORMAT = "awq"
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds channel 8j + ORDER[i]


def read_quant_config(spec: dict[str, Any]) -> dict[str, Any]:
    bits = spec.get("bits", spec.get("w_bit"))
    group = spec.get("group_size", spec.get("q_group_size"))
    version = str(spec.get("version", "gemm")).lower()
    if bits != 4:
        raise ModelLoadError(f"{bits}-bit AWQ is not supported (4-bit is)")
    if group not in INT4_GROUP_SIZES:
        raise ModelLoadError(f"AWQ with group size {group} is not supported "
                             f"(one of {list(INT4_GROUP_SIZES)})")
    if version != "gemm":
        raise ModelLoadError(f"AWQ version {version!r} is not supported (gemm is)")
    return {"format": FORMAT, "bits": 4, "method": "int4", "group_size": group,
            "sym": not spec.get("zero_point", True)}


def unpack(packed: Tensor) -> Tensor:
    """(R, N / 8) int32 -> (R, N) uint8 codes in channel order."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    nibbles = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=-1)  # [.., j, i]
    codes = torch.empty_like(nibbles)
    codes[..., list(ORDER)] = nibbles  # channel ORDER[i] of the word <- nibble i
    return codes.flatten(-2).to(torch.uint8)


def to_values(tensors: dict[str, Tensor], base: str, spec: dict[str, Any]) -> QuantValues:
    try:
        qweight, scales = tensors[f"{base}.qweight"], tensors[f"{base}.scales"]
    except KeyError as exc:
        raise ModelLoadError(f"AWQ checkpoint lacks {exc.args[0]}") from exc
    q = unpack(qweight).T.contiguous()  # (N, K)
    n, k = q.shape
    groups = scales.shape[0]
    if k % groups or k // groups != spec["group_size"] or scales.shape[1] != n:
        raise ModelLoadError(f"{base}: AWQ scales {tuple(scales.shape)} do not match "
                             f"qweight {tuple(qweight.shape)} in groups of {spec['group_size']}")
    qzeros = tensors.get(f"{base}.qzeros")
    zero = unpack(qzeros).T.float() if qzeros is not None and not spec["sym"] else \
        torch.full((n, groups), 8.0)
    return QuantValues(4, q, scales.T.float().contiguous(), zero.contiguous())


def take_quantized(tensors: dict[str, Tensor], spec: dict[str, Any]) -> dict[str, QuantValues]:
    """Pop every AWQ layer out of `tensors`: QuantValues by HF layer name (no `.weight`)."""
    bases = [name.removesuffix(".qweight") for name in tensors if name.endswith(".qweight")]
    values = {base: to_values(tensors, base, spec) for base in bases}
    for base in bases:
        for suffix in ("qweight", "qzeros", "scales"):
            tensors.pop(f"{base}.{suffix}", None)
    return values
