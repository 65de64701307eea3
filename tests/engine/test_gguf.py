"""GGUF checkpoints (`--model file.gguf`, models/gguf_import.py), written from tiny random
checkpoints of each family served (Llama-style dense, Mixtral-style MoE, Qwen2, Qwen3,
Qwen3-MoE) by our exporter (models/gguf_export.py, llama.cpp's layout): float files load to the
same model as the safetensors, Q4_0 and Q4_K to exactly their own values (int4 groups of 32),
Q8_0, Q5_K and Q6_K to evenflow's int8 within that requantization's rounding (which stays below
the formats' own error), the K-quant mixes likewise; the block decoders agree with gguf-py's;
the tokenizer and chat template come along; what cannot be served is said plainly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from checkpoints import make_checkpoint

from evenflow import LLM, SamplingParams
from evenflow.engine.quant.stacks import QuantConfig, quantize
from evenflow.engine.runners.model_runner import ChunkInput
from evenflow.engine.weights.quantize_model import QuantLinear
from evenflow.models import gguf_blocks, gguf_kquants, resolve_model
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


def quantized_bits(llm) -> set[int]:
    return {m.weight_q.bits for m in llm.engine.model.modules() if isinstance(m, QuantLinear)}


def test_q4_0_loads_to_its_own_values_and_q8_0_to_int8(family, tmp_path, monkeypatch):
    monkeypatch.setenv("EVENFLOW_NATIVE_W4A8", "0")  # the weights alone: rows at full precision
    for kind, bits, tolerance in (("q4_0", 4, 1e-4), ("q8_0", 8, 3e-2)):
        gguf = export_gguf(family, tmp_path / f"model-{kind}.gguf", kind)
        reference = tmp_path / f"{kind}-dequantized"
        reference.mkdir()
        convert(gguf, reference, dequantize_all=True)
        llm = LLM(str(gguf), dtype="float32")
        assert llm.engine.config.quantization is None  # (the file's own forms, per layer)
        assert quantized_bits(llm) == {bits}
        want = logits(reference)
        assert (logits(gguf) - want).abs().max() < tolerance * want.abs().max(), kind


def random_blocks(kind: int, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Any bytes are valid blocks once their float16 scales are sane."""
    weights, size, _ = gguf_blocks.LAYOUT[kind]
    raw = rng.integers(0, 256, (rows, k // weights, size), dtype=np.uint8)
    halves = {gguf_blocks.Q6_K: (208,), gguf_blocks.Q4_K: (0, 2), gguf_blocks.Q5_K: (0, 2),
              gguf_blocks.Q4_1: (0, 2), gguf_blocks.Q5_1: (0, 2)}
    for at in halves.get(kind, (0,)):
        d = rng.uniform(1e-3, 1e-2, raw.shape[:2]).astype(np.float16)
        raw[..., at:at + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(gguf_blocks.LAYOUT))
def test_blocks_decode_as_gguf_py_reads_them(kind):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = random_blocks(kind, 5, 512, np.random.default_rng(kind))
    theirs = dequantize(raw, GGMLQuantizationType(kind))
    assert np.array_equal(gguf_blocks.decode(kind, raw, 512).dequantize(), theirs)
    if kind in (gguf_blocks.Q4_K, gguf_blocks.Q5_K, gguf_blocks.Q6_K):  # our encoder, read back
        w = np.random.default_rng(1).standard_normal((4, 512)).astype(np.float32)
        again = dequantize(gguf_kquants.encode(kind, w), GGMLQuantizationType(kind))
        bound = {gguf_blocks.Q4_K: 0.12, gguf_blocks.Q5_K: 0.06, gguf_blocks.Q6_K: 0.03}[kind]
        assert np.sqrt(((again - w) ** 2).mean()) < bound * w.std()


@pytest.mark.parametrize("kind", [gguf_blocks.Q5_K, gguf_blocks.Q6_K])
def test_int8_from_a_k_quant_adds_less_than_the_files_own_error(kind):
    """Q5_K / Q6_K load as int8 per channel: quantized again from the file's values, the
    further error (int8 against the file) stays below the file's own (file against the original
    weights), on gaussian rows of a real model's width."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    w = np.random.default_rng(2).standard_normal((64, 2048)).astype(np.float32) * 0.02
    raw = gguf_kquants.encode(kind, w)
    file = dequantize(raw, GGMLQuantizationType(kind))
    again = quantize(torch.from_numpy(file), QuantConfig("int8")).dequantize().numpy()
    own, added = np.sqrt(((file - w) ** 2).mean()), np.sqrt(((again - file) ** 2).mean())
    assert added < own, (added, own)


@pytest.fixture(scope="module")
def wide_moe(tmp_path_factory):
    """A Mixtral whose rows hold whole K-quant super-blocks (256)."""
    path = tmp_path_factory.mktemp("mixtral256")
    make_checkpoint("mixtral", path, overrides=dict(hidden_size=256, intermediate_size=256))
    return path


@pytest.mark.parametrize("kind, bits, tolerance", [
    ("q4_k", {4}, 1e-4), ("q6_k", {8}, 3e-2), ("q5_k", {8}, 3e-2),
    ("q4_k_m", {4, 8}, 3e-2), ("q5_k_m", {8}, 3e-2)])
def test_k_quant_files_load_to_their_own_values(wide_moe, tmp_path, monkeypatch, kind, bits,
                                                tolerance):
    monkeypatch.setenv("EVENFLOW_NATIVE_W4A8", "0")  # the weights alone: rows at full precision
    gguf = export_gguf(wide_moe, tmp_path / f"model-{kind}.gguf", kind)
    reference = tmp_path / "dequantized"
    reference.mkdir()
    convert(gguf, reference, dequantize_all=True)
    llm = LLM(str(gguf), dtype="float32")
    assert quantized_bits(llm) == bits
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


def test_a_gguf_is_served_under_its_general_name_with_its_chat_template(tmp_path):
    """`evenflow up --model file.gguf`: clients name the model as the file does (general.name),
    or as --served-model-name says, and chat requests get the file's chat template."""
    import json

    from evenflow.engine.weights.loader import resolve_model as engine_resolve
    from evenflow.services.config import load_config

    source = engine_resolve("tiny-moe")
    gguf = export_gguf(source, tmp_path / "exported-q8.gguf", "q8_0")
    assert load_config({"model": str(gguf)}).model_name == "tiny-moe"
    assert load_config({"model": str(gguf), "served_model_name": "mine"}).model_name == "mine"
    served = json.loads((resolve_model(str(gguf)) / "tokenizer_config.json").read_text())
    shipped = json.loads((source / "tokenizer_config.json").read_text())
    assert served["chat_template"] == shipped["chat_template"]
