"""Pre-quantized checkpoints in the GPTQ layout (as AutoGPTQ/GPTQModel write, and transformers and
vLLM read): reading them, and writing them from a bf16/fp32 checkpoint with our quantizer.

Per quantized linear layer `<name>` (HF names: q_proj, k_proj, ..., experts.{e}.w1/w2/w3):
- `<name>.qweight` int32 (K * bits / 32, N): q[k, n] of 32 / bits consecutive k packed into one
  int32, the lowest k in the lowest bits;
- `<name>.scales` float16 (K / group, N);
- `<name>.qzeros` int32 (K / group, N * bits / 32): zero points packed along N the same way,
  stored minus one ("gptq" checkpoint format; "gptq_v2" stores them as they are);
- `<name>.g_idx` int32 (K,): k // group (act-order checkpoints, with any other order, are
  refused);
- w[n, k] = scales[g, n] * (q[k, n] - zero[g, n]).
config.json carries `quantization_config: {quant_method: gptq, bits, group_size, sym, desc_act,
checkpoint_format}`; group_size -1 means one group per row.

Supported: 4-bit with any group size the int4 kernels take (32/64/128), symmetric or not; 8-bit
per-channel symmetric (our int8). compressed-tensors' int8 has its own module
(compressed_tensors.py), AWQ, FP8 and GGUF theirs (awq.py, fp8_blockwise.py, gguf_weights.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from evenflow.engine.config.settings import INT4_GROUP_SIZES, ModelConfig, ModelLoadError
from evenflow.engine.quant.fp8 import Fp8Values
from evenflow.engine.quant.stacks import QuantConfig, QuantValues, quantize
from evenflow.engine.weights.hf_names import EXPERT, RENAMES, ROLE
from evenflow.engine.weights.quantized_copy import write_quantized_copy


def read_quant_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's quantization_config if it is GPTQ we can load (with our `method` added);
    None if unquantized."""
    spec = config.get("quantization_config")
    if not spec:
        return None
    method = spec.get("quant_method")
    if method == "mxfp4":  # GPT-OSS's experts: kept as stored (engine/quant/mxfp4.py)
        return None
    if method != "gptq":
        raise ModelLoadError(f"checkpoint quantization {method!r} is not supported (GPTQ, AWQ, "
                             f"FP8 block-wise, MXFP4, GGUF and compressed-tensors int8 are; or "
                             f"load the unquantized checkpoint with --quantization)")
    bits, group = spec.get("bits"), spec.get("group_size", -1)
    if bits == 4 and group not in INT4_GROUP_SIZES:
        raise ModelLoadError(f"4-bit GPTQ with group size {group} is not supported "
                             f"(one of {list(INT4_GROUP_SIZES)})")
    if bits == 8 and (group != -1 or not spec.get("sym", True)):
        raise ModelLoadError("8-bit GPTQ is supported per channel and symmetric only "
                             "(group_size -1, sym true)")
    if bits not in (4, 8):
        raise ModelLoadError(f"{bits}-bit GPTQ is not supported (4 or 8)")
    return {**spec, "method": "int8" if bits == 8 else "int4"}


def _shifts(bits: int) -> Tensor:
    return torch.arange(0, 32, bits, dtype=torch.int32)


def _unpack_rows(packed: Tensor, bits: int) -> Tensor:
    """(R, C) int32 -> (R * 32 / bits, C): values packed along the rows."""
    vals = (packed.unsqueeze(1) >> _shifts(bits).view(1, -1, 1)) & ((1 << bits) - 1)
    return vals.reshape(-1, packed.shape[1])


def _unpack_cols(packed: Tensor, bits: int) -> Tensor:
    vals = (packed.unsqueeze(2) >> _shifts(bits).view(1, 1, -1)) & ((1 << bits) - 1)
    return vals.reshape(packed.shape[0], -1)


def _pack_rows(values: Tensor, bits: int) -> Tensor:
    """(R, C) small ints -> (R * bits / 32, C) int32."""
    per = 32 // bits
    v = values.to(torch.int64).view(-1, per, values.shape[1])
    word = (v << _shifts(bits).to(torch.int64).view(1, -1, 1)).sum(dim=1)
    return ((word + 2**31) % 2**32 - 2**31).to(torch.int32)


def _pack_cols(values: Tensor, bits: int) -> Tensor:
    return _pack_rows(values.T.contiguous(), bits).T.contiguous()


def to_values(tensors: dict[str, Tensor], base: str, spec: dict[str, Any]) -> QuantValues:
    """One layer's QuantValues from its GPTQ tensors."""
    bits = int(spec["bits"])
    try:
        qweight, scales, qzeros = (tensors[f"{base}.{s}"] for s in ("qweight", "scales",
                                                                     "qzeros"))
    except KeyError as exc:
        raise ModelLoadError(f"GPTQ layer {base} lacks {exc.args[0]}") from exc
    q = _unpack_rows(qweight, bits).T.contiguous()  # (N, K)
    n, k = q.shape
    groups = scales.shape[0]
    g_idx = tensors.get(f"{base}.g_idx")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // (k // groups)):
        raise ModelLoadError(f"{base}: act-order (desc_act) GPTQ checkpoints are not supported")
    zero = _unpack_cols(qzeros, bits).T.float()  # (N, G)
    if spec.get("checkpoint_format", "gptq") == "gptq":
        zero = zero + 1
    scale = scales.T.float().contiguous()
    if bits == 8:
        return QuantValues(8, (q.to(torch.int16) - 128).to(torch.int8), scale, None)
    return QuantValues(4, q.to(torch.uint8), scale, zero.contiguous())


def take_quantized(tensors: dict[str, Tensor], spec: dict[str, Any]
                   ) -> dict[str, QuantValues]:
    """Pop every GPTQ layer out of `tensors`: QuantValues by HF layer name (no `.weight`)."""
    bases = [name[: -len(".qweight")] for name in tensors if name.endswith(".qweight")]
    values = {base: to_values(tensors, base, spec) for base in bases}
    for base in bases:
        for suffix in ("qweight", "scales", "qzeros", "g_idx"):
            tensors.pop(f"{base}.{suffix}", None)
    return values


def _concat(parts: list[QuantValues]) -> QuantValues:
    """Stack weights along N (fused q/k/v, gate/up)."""
    if isinstance(parts[0], Fp8Values):  # (FP8 block-wise checkpoints share this mapping)
        return Fp8Values.concat(parts)  # type: ignore[arg-type,return-value]
    if {p.bits for p in parts} == {4, 5} and all(p.zero is not None for p in parts):
        parts = [QuantValues(5, p.q, p.scale, p.zero) for p in parts]  # (codes 0..15 fit)
    forms = {(p.bits, p.group_size, p.zero is None, p.int8_activations) for p in parts}
    if len(forms) > 1:  # (a GGUF mix: Q4_K_M's V in Q6_K beside Q and K in Q4_K)
        whole = torch.cat([p.dequantize() for p in parts])
        return quantize(whole, QuantConfig("int8"))
    zeros = [p.zero for p in parts]
    zero = None if zeros[0] is None else torch.cat(zeros)  # type: ignore[arg-type]
    return QuantValues(parts[0].bits, torch.cat([p.q for p in parts]),
                       torch.cat([p.scale for p in parts]), zero, parts[0].int8_activations)


def to_model_values(cfg: ModelConfig, layer: int, values: dict[str, QuantValues]
                    ) -> dict[str, list[QuantValues]]:
    """GPTQ layers of one decoder layer, renamed (and fused) to the model's modules, relative
    to the layer: `self_attn.qkv_proj`, `mlp.w13` (one entry per expert), ..."""
    prefix = f"model.layers.{layer}."
    local = {_renamed(name).removeprefix(prefix): v for name, v in values.items()
             if name.startswith(prefix)}
    out: dict[str, list[QuantValues]] = {}
    qkv = [] if cfg.mla else [local.pop(f"self_attn.{p}_proj", None) for p in "qkv"]
    if qkv and all(v is not None for v in qkv):
        out["self_attn.qkv_proj"] = [_concat(qkv)]  # type: ignore[arg-type]
    elif any(v is not None for v in qkv):
        raise ModelLoadError(f"{prefix}self_attn: only some of q/k/v are quantized")
    experts: dict[tuple[int, str], QuantValues] = {}
    for name in list(local):
        if m := EXPERT.match(prefix + name):
            experts[(int(m[2]), ROLE[m[3]])] = local.pop(name)
    if experts:
        try:
            out["mlp.w13"] = [_concat([experts[(e, "gate")], experts[(e, "up")]])
                              for e in range(cfg.num_experts)]
            out["mlp.w2"] = [experts[(e, "down")] for e in range(cfg.num_experts)]
        except KeyError as exc:
            raise ModelLoadError(f"{prefix}: GPTQ checkpoint lacks expert {exc.args[0]}") from exc
    out.update({name: [v] for name, v in local.items()})  # o_proj, mlp.*_proj, shared_expert
    return out


def _renamed(name: str) -> str:
    for old, new in RENAMES:
        name = name.replace(old, new)
    return name


def write_gptq(source: str | Path, out: str | Path, config: QuantConfig) -> Path:
    """Quantize an unquantized HF checkpoint with our quantizer and write it in GPTQ layout
    (config, tokenizer and other files copied). int8 -> 8-bit per channel, int4 -> 4-bit."""
    bits = 8 if config.method == "int8" else 4
    return write_quantized_copy(
        source, out, config.fits, lambda base, w: _gptq_tensors(base, w, config, bits),
        {"quant_method": "gptq", "bits": bits, "checkpoint_format": "gptq", "desc_act": False,
         "group_size": -1 if bits == 8 else config.group_size,
         "sym": True if bits == 8 else config.symmetric})


def _gptq_tensors(base: str, weight: Tensor, config: QuantConfig, bits: int
                  ) -> dict[str, Tensor]:
    values = quantize(weight, config)
    n, k = values.q.shape
    if bits == 8:
        q = values.q.to(torch.int16) + 128
        zero = torch.full((n, 1), 128)
    else:
        q = values.q.to(torch.int16)
        zero = values.zero if values.zero is not None else torch.full_like(values.scale, 8)
    groups = values.scale.shape[1]
    return {f"{base}.qweight": _pack_rows(q.T.contiguous(), bits),
            f"{base}.scales": values.scale.T.to(torch.float16).contiguous(),
            f"{base}.qzeros": _pack_cols((zero.T - 1).to(torch.int64), bits),
            f"{base}.g_idx": (torch.arange(k) // (k // groups)).to(torch.int32)}
