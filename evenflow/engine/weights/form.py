"""What form an engine's weights take, in the words a user picked them by: bf16, int8,
int4-g32 W4A8, w8a8, MXFP4, FP8 block-wise, GGUF Q4_K ... (for the workers' ready lines and
/v1/models). Read from the settings and the checkpoint's config, not from the loaded modules."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from evenflow.engine.config.settings import EngineConfig, switched_on
from evenflow.engine.kernels import native

_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def short_dtype(dtype: torch.dtype) -> str:
    """bf16, fp16, fp32, or torch's own name (int8, ...)."""
    return _SHORT.get(dtype, str(dtype).removeprefix("torch."))


def weight_form(config: EngineConfig, model_dir: Path, dtype: torch.dtype) -> str:
    """e.g. "int4-g32 W4A8 (bf16 rest)": the quantized layers' form, then the plain ones'."""
    plain = short_dtype(dtype)
    if config.quantization == "int4":
        return f"int4-g{config.quant_group_size}{_w4a8()} ({plain} rest)"
    if config.quantization in ("int8", "w8a8"):
        return f"{config.quantization} ({plain} rest)"
    try:
        spec = json.loads((model_dir / "config.json").read_text()).get(
            "quantization_config") or {}
    except (OSError, ValueError):
        spec = {}
    method = str(spec.get("quant_method") or "")
    if method == "mxfp4":
        return f"MXFP4 experts{_w4a8()} ({plain} rest)"
    if method == "fp8":
        block = "x".join(map(str, spec.get("weight_block_size") or [])) or "?"
        return f"FP8 e4m3 block-wise {block} ({plain} rest)"
    if method == "gguf":
        return f"GGUF {_gguf_types(model_dir)} ({plain} rest)"
    if method in ("gptq", "awq"):
        bits, group = spec.get("bits", spec.get("w_bit")), spec.get(
            "group_size", spec.get("q_group_size"))
        grouped = f"-g{group}" if group not in (None, -1) else ""
        return f"{method.upper()} int{bits}{grouped}{_w4a8() if bits == 4 else ''} " \
               f"({plain} rest)"
    if method:
        return f"{method} ({plain} rest)"
    return plain


def _w4a8() -> str:
    """" W4A8" where 4-bit weights meet int8 rows on VNNI (engine/quant/panel_stack.py)."""
    return " W4A8" if native.w8a8_supported() and switched_on("EVENFLOW_NATIVE_W4A8") else ""


def _gguf_types(model_dir: Path) -> str:
    """The file's weight types, most common first (Q4_K/Q5_0/Q8_0 for a Q4_K_M file of
    narrow rows): its quantized ones, else its float ones."""
    from evenflow.models.gguf_import import gguf_tensor_types

    counts = gguf_tensor_types(model_dir)  # type name -> matrices
    floats = {"f32", "f16", "bf16"}
    shown = {k: n for k, n in counts.items() if k.lower() not in floats} or counts
    return "/".join(k.upper() for k in sorted(shown, key=lambda k: -shown[k])) or "(no matrices)"
