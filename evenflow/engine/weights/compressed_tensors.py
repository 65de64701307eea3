"""Pre-quantized checkpoints in compressed-tensors' int8 format (as llm-compressor writes and vLLM
reads: `quant_method: compressed-tensors`, `format: int-quantized`): reading them, and writing
them from a bf16/fp32 checkpoint with our quantizer.

Per quantized linear layer `<name>` (HF names, as GPTQ's: q_proj, ..., experts.{e}.w1/w2/w3):
- `<name>.weight` int8 (N, K), symmetric, in [-127, 127];
- `<name>.weight_scale` (N, 1) float (the model's dtype when llm-compressor writes it; we write
  float32): w[n, k] = weight[n, k] * weight_scale[n].
config.json carries one config group whose `weights` are 8-bit int, symmetric, per channel
(`strategy: channel`), and whose `input_activations` are either 8-bit int, symmetric, dynamic,
per token (W8A8: our `w8a8`) or absent (W8A16: our weight-only `int8`). Layers in `ignore` (and
any other without a `weight_scale`) are stored unquantized. Other schemes (groups, fp8, 4-bit,
static activation scales) are refused with a clear error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from evenflow.engine.config.settings import ModelLoadError
from evenflow.engine.quant.stacks import QuantConfig, QuantValues, quantize
from evenflow.engine.weights.quantized_copy import write_quantized_copy

FORMAT = "compressed-tensors"
# (the router gates are nn.Linear in transformers but never quantized: vLLM keeps them too)
IGNORED = ["lm_head", "re:.*block_sparse_moe\\.gate$", "re:.*mlp\\.gate$"]


def _int8(args: dict[str, Any] | None, what: str) -> None:
    if not args or args.get("num_bits") != 8 or args.get("type", "int") != "int" or \
            not args.get("symmetric", True):
        raise ModelLoadError(f"compressed-tensors {what}: only symmetric 8-bit int is supported, "
                             f"got {args}")


def read_quant_config(spec: dict[str, Any]) -> dict[str, Any]:
    """Our summary of a compressed-tensors quantization_config: {"format", "method" (w8a8 or
    int8), "bits"}; ModelLoadError for what we cannot serve."""
    if spec.get("format") not in ("int-quantized", "naive-quantized"):
        raise ModelLoadError(f"compressed-tensors format {spec.get('format')!r} is not "
                             "supported (int-quantized is: W8A8 / W8A16 int8 per channel)")
    groups = list((spec.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ModelLoadError(f"compressed-tensors checkpoints with {len(groups)} config groups "
                             "are not supported (one)")
    weights, inputs = groups[0].get("weights"), groups[0].get("input_activations")
    _int8(weights, "weights")
    if weights.get("strategy") != "channel":
        raise ModelLoadError("compressed-tensors int8 weights must be per channel "
                             f"(strategy channel), got {weights.get('strategy')!r}")
    if inputs is not None:
        _int8(inputs, "input activations")
        if not inputs.get("dynamic") or inputs.get("strategy") != "token":
            raise ModelLoadError("compressed-tensors int8 activations must be dynamic per "
                                 f"token, got {inputs}")
    return {"format": FORMAT, "bits": 8, "method": "w8a8" if inputs else "int8"}


def take_quantized(tensors: dict[str, Tensor], spec: dict[str, Any]) -> dict[str, QuantValues]:
    """Pop every quantized layer out of `tensors`: QuantValues by HF layer name (no `.weight`)."""
    bases = [name[: -len(".weight_scale")] for name in tensors if name.endswith(".weight_scale")]
    values = {}
    for base in bases:
        q, scale = tensors.pop(f"{base}.weight", None), tensors.pop(f"{base}.weight_scale")
        if q is None or q.dtype != torch.int8 or q.dim() != 2 or \
                scale.numel() != q.shape[0]:
            raise ModelLoadError(f"compressed-tensors layer {base}: expected an int8 (N, K) "
                                 f"weight with N scales")
        zero = tensors.pop(f"{base}.weight_zero_point", None)
        if zero is not None and bool(zero.ne(0).any()):
            raise ModelLoadError(f"{base}: asymmetric int8 weights are not supported")
        tensors.pop(f"{base}.input_scale", None)
        tensors.pop(f"{base}.input_zero_point", None)
        values[base] = QuantValues(8, q.contiguous(), scale.float().reshape(-1, 1), None,
                                   spec["method"] == "w8a8")
    return values


def quantization_config(method: str) -> dict[str, Any]:
    """The config.json entry for our int8 (W8A16) or w8a8 (W8A8) checkpoints."""
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
               "dynamic": False, "group_size": None, "block_structure": None,
               "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    inputs = None if method == "int8" else {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True,
        "group_size": None, "block_structure": None, "actorder": None, "observer": None,
        "observer_kwargs": {}}
    return {"quant_method": FORMAT, "format": "int-quantized",
            "quantization_status": "compressed", "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": inputs,
                                          "output_activations": None}},
            "ignore": IGNORED}


def write_compressed_tensors(source: str | Path, out: str | Path, config: QuantConfig) -> Path:
    """Quantize an unquantized HF checkpoint (int8 or w8a8) with our quantizer and write it in
    compressed-tensors' int-quantized layout (config, tokenizer and other files copied)."""
    if config.method not in ("int8", "w8a8"):
        raise ValueError(f"compressed-tensors checkpoints here are int8 or w8a8, not "
                         f"{config.method}")
    w8a8 = QuantConfig("w8a8")  # (int8's weights are the same numbers: symmetric, per channel)

    def convert(base: str, weight: Tensor) -> dict[str, Tensor]:
        values = quantize(weight, w8a8)
        return {f"{base}.weight": values.q,
                f"{base}.weight_scale": values.scale.float().contiguous()}

    return write_quantized_copy(source, out, w8a8.fits, convert,
                                quantization_config(config.method))
