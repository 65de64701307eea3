"""GGUF checkpoints (`--model file.gguf`, models/gguf_import.py), written from tiny random
checkpoints of each family served (Llama-style dense, Mixtral-style MoE, Qwen2, Qwen3,
Qwen3-MoE) by our exporter (models/gguf_export.py, llama.cpp's layout): float files load to the
same model as the safetensors, Q4_0 to exactly its own values (GPTQ int4 groups of 32), Q8_0 to
evenflow's int8 within that requantization's rounding; the tokenizer comes along; what cannot
be served is said plainly."""

from __future__ import annotations

import pytest
from checkpoints import make_checkpoint

from evenflow import LLM, SamplingParams
from evenflow.engine.runners.model_runner import ChunkInput
from evenflow.models import resolve_model
from evenflow.models.gguf_export import export_gguf
from evenflow.models.gguf_import import GGUFError, convert

PROMPT = list(range(3, 30))
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture(scope="module", params=["mixtral", "llama", "qwen2", "qwen3", "qwen3_moe"])
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, path)
    return path


def logits(model) -> object:
    runner = LLM(str(model), dtype="float32").engine.runner
    return runner.forward([ChunkInput(PROMPT, 0, [0, 1], True, every_row=True)])


def greedy(model) -> list[int]:
    return LLM(str(model), dtype="float32").generate([PROMPT], GREEDY)[0].token_ids


def test_a_float_gguf_is_the_same_model(family, tmp_path):
    gguf = export_gguf(family, tmp_path / "model-f32.gguf", "f32")
    assert greedy(gguf) == greedy(family)
    assert (logits(gguf) - logits(family)).abs().max() < 1e-5


def test_q4_0_loads_to_its_own_values_and_q8_0_to_int8(family, tmp_path, monkeypatch):
    monkeypatch.setenv("EVENFLOW_NATIVE_W4A8", "0")  # the weights alone: rows at full precision
    for kind, method, tolerance in (("q4_0", None, 1e-4), ("q8_0", "int8", 3e-2)):
        gguf = export_gguf(family, tmp_path / f"model-{kind}.gguf", kind)
        reference = tmp_path / f"{kind}-dequantized"
        reference.mkdir()
        convert(gguf, reference, dequantize_all=True)
        llm = LLM(str(gguf), dtype="float32")
        assert llm.engine.config.quantization == method  # Q4_0: GPTQ in the directory
        want = logits(reference)
        assert (logits(gguf) - want).abs().max() < tolerance * want.abs().max(), kind


def test_text_in_text_out_with_the_files_tokenizer(tmp_path):
    from evenflow.engine.weights.loader import resolve_model as engine_resolve

    gguf = export_gguf(engine_resolve("tiny-moe"), tmp_path / "tiny-moe-bf16.gguf", "bf16")
    llm = LLM(str(gguf))
    text = llm.generate(["count from 7 :"], SamplingParams(temperature=0, max_tokens=3))[0].text
    assert text.split() == ["7", "8", "9"]


def test_an_architecture_not_served_is_said_plainly(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "other.gguf"
    writer = GGUFWriter(str(path), "rwkv6")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="rwkv6"):
        resolve_model(str(path))
