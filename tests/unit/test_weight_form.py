"""The weight form a worker reports (ready line, /v1/models), in the words a user picked it
by: from --quantization, else from the checkpoint's quantization_config."""

from __future__ import annotations

import json

import pytest
import torch

from evenflow.engine.config.settings import EngineConfig
from evenflow.engine.kernels import native
from evenflow.engine.weights.form import weight_form

W4A8 = " W4A8" if native.w8a8_supported() else ""


def checkpoint(tmp_path, quantization_config=None):
    config = {"model_type": "qwen3_moe"}
    if quantization_config:
        config["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("settings, spec, expected", [
    ({}, None, "bf16"),
    ({"quantization": "int4", "quant_group_size": 32}, None, f"int4-g32{W4A8} (bf16 rest)"),
    ({"quantization": "int8"}, None, "int8 (bf16 rest)"),
    ({"quantization": "w8a8"}, None, "w8a8 (bf16 rest)"),
    ({}, {"quant_method": "mxfp4"}, f"MXFP4 experts{W4A8} (bf16 rest)"),
    ({}, {"quant_method": "fp8", "weight_block_size": [128, 128]},
     "FP8 e4m3 block-wise 128x128 (bf16 rest)"),
    ({}, {"quant_method": "gptq", "bits": 8, "group_size": -1}, "GPTQ int8 (bf16 rest)"),
    ({}, {"quant_method": "awq", "bits": 4, "group_size": 128},
     f"AWQ int4-g128{W4A8} (bf16 rest)"),
])
def test_the_form_names_what_the_user_chose(tmp_path, settings, spec, expected):
    model = checkpoint(tmp_path, spec)
    config = EngineConfig(model=str(model), **settings)
    assert weight_form(config, model, torch.bfloat16) == expected


def test_a_gguf_names_its_block_types_most_common_first(tmp_path):
    from evenflow.models.gguf_import import HINT_FILE

    model = checkpoint(tmp_path, {"quant_method": "gguf"})
    counts = {"q4_k": 2, "q6_k": 1, "f32": 5}  # (as the converter writes them: type -> count)
    (model / HINT_FILE).write_text(json.dumps({"source": "x.gguf", "tensor_types": counts}))
    assert weight_form(EngineConfig(model=str(model)), model, torch.float32) == \
        "GGUF Q4_K/Q6_K (fp32 rest)"


def test_a_llama_quantize_file_names_its_types():
    """The real thing: llama-quantize's Q4_K_M of tiny-moe (tests/data/llamacpp)."""
    from pathlib import Path

    from evenflow.models import resolve_model

    gguf = Path(__file__).resolve().parents[1] / "data" / "llamacpp" / "tiny-moe-Q4_K_M.gguf"
    model = resolve_model(str(gguf))
    form = weight_form(EngineConfig(model=str(model)), model, torch.bfloat16)
    assert form.startswith("GGUF Q5_0/") and "Q4_K" in form, form
