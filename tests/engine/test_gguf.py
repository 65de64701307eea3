"""GGUF checkpoints (`--model file.gguf`, models/gguf_import.py), written from tiny random
checkpoints of each family served (Llama-style dense, Mixtral-style MoE, Qwen2, Qwen3,
Qwen3-MoE, DeepSeek-V3, GPT-OSS) by our exporter (models/gguf_export.py, llama.cpp's layout):
float files load to the same model as the safetensors, Q4_0 and Q4_K to exactly their own
values (int4 groups of 32), Q5_K to its own 5-bit codes where the VNNI panels serve, Q8_0, Q6_K
(and Q5_K elsewhere) to evenflow's int8 within that requantization's
rounding (which stays below the formats' own error), the K-quant mixes likewise; MXFP4 experts
stay MXFP4 both ways; older deepseek2 files (one attn_kv_b) load too; the block decoders agree
with gguf-py's; the tokenizer and chat template come along; what cannot be served is said
plainly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from checkpoints import make_checkpoint

from evenflow import LLM, SamplingParams
from evenflow.engine.quant.stacks import QuantConfig, quantize
from evenflow.engine.runners.model_runner import ChunkInput
from evenflow.engine.weights.quantize_model import QuantLinear
from evenflow.models import gguf_blocks, gguf_import, gguf_kquants, resolve_model
from evenflow.models.gguf_export import export_gguf
from evenflow.models.gguf_import import GGUFError, convert

PROMPT = list(range(3, 30))
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Converted files under the test's own directory (not XDG_CACHE_HOME: the native kernels'
    build would start again in every test session)."""
    monkeypatch.setattr(gguf_import, "cache_root", lambda: tmp_path / "cache")


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


@pytest.fixture(scope="module", params=["deepseek_v3", "gpt_oss"])
def mla_or_sinks(request, tmp_path_factory):
    """deepseek2 (MLA with q_lora, a dense layer, shared experts, sigmoid groups) and gpt-oss
    (sinks, a sliding layer, biases, the clamped SwiGLU, YaRN)."""
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, path)
    return path


def test_float_deepseek2_and_gpt_oss_ggufs_are_the_same_model(mla_or_sinks, tmp_path):
    gguf = export_gguf(mla_or_sinks, tmp_path / "model-f32.gguf", "f32")
    assert greedy(gguf) == greedy(mla_or_sinks)
    assert (logits(gguf) - logits(mla_or_sinks)).abs().max() < 1e-5


def test_quantized_deepseek2_and_gpt_oss_ggufs_load_and_generate(mla_or_sinks, tmp_path,
                                                                 monkeypatch):
    monkeypatch.setenv("EVENFLOW_NATIVE_W4A8", "0")  # the weights alone: rows at full precision
    for kind, bits in (("q4_0", 4), ("q8_0", 8)):
        gguf = export_gguf(mla_or_sinks, tmp_path / f"model-{kind}.gguf", kind)
        reference = tmp_path / f"{kind}-dequantized"
        reference.mkdir()
        convert(gguf, reference, dequantize_all=True)
        llm = LLM(str(gguf), dtype="float32")
        assert quantized_bits(llm) == {bits}
        assert len(llm.generate([PROMPT], GREEDY)[0].token_ids) == GREEDY.max_tokens
        want, got = logits(reference), logits(gguf)
        rows = (got - want).abs().amax(-1) / want.abs().max()
        if kind == "q4_0":  # exactly the file's values
            assert rows.max() < 1e-4
        else:  # int8 within its rounding, but for a token int8 may route to other experts
            # (random DeepSeek weights leave near ties in its sigmoid-and-groups router)
            assert (rows < 3e-2).float().mean() > 0.9, rows


def test_an_older_deepseek2_file_with_one_attn_kv_b_loads_too(tmp_path):
    """llama.cpp's files before it split kv_b (attn_kv_b, the per-head key and value lengths
    as key_length / value_length, head_count_kv = heads) are the same model."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    source = tmp_path / "deepseek_v3"
    make_checkpoint("deepseek_v3", source)
    reader = GGUFReader(str(export_gguf(source, tmp_path / "current.gguf", "f32")))
    old = tmp_path / "old.gguf"
    writer = GGUFWriter(str(old), "deepseek2")
    lengths = {"key_length": 32, "value_length": 24, "head_count_kv": 4}  # nope+rope, v, heads
    for key, field in reader.fields.items():
        name = key.removeprefix("deepseek2.attention.")
        if key.startswith("GGUF.") or key == "general.architecture" or name.endswith("_mla"):
            continue
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        value = lengths.get(name, field.contents())
        writer.add_key_value(key, value, field.types[0], sub)
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    for name, value in tensors.items():
        if name.endswith("attn_k_b.weight"):  # (heads, kv_lora, nope) and (heads, v, kv_lora)
            v_b = tensors[name.replace("attn_k_b", "attn_v_b")]
            value = np.concatenate([value.swapaxes(1, 2), v_b], axis=1).reshape(-1, 32)
            name = name.replace("attn_k_b", "attn_kv_b")
        if not name.endswith("attn_v_b.weight"):
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert (logits(old) - logits(source)).abs().max() < 1e-5


def test_mxfp4_experts_stay_mxfp4_into_gguf_and_back(tmp_path, monkeypatch):
    """GPT-OSS as it ships (experts in MXFP4: blocks + scales) exports its experts as GGUF's
    MXFP4, repacked, not requantized: gguf-py reads the checkpoint's values from the file, and
    the file loads with its experts at 4.25 bits a weight to the checkpoint's model;
    `mxfp4_moe` makes a float checkpoint's experts MXFP4 (the rest Q8_0)."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import load_file, save_file

    from evenflow.engine.model.moe import MoE
    from evenflow.engine.quant import mxfp4
    from evenflow.engine.quant.mxfp4 import Mxfp4Stack

    monkeypatch.setenv("EVENFLOW_NATIVE_W4A8", "0")  # the torch fallback: exact dequantization
    source, shipped = tmp_path / "gpt_oss", tmp_path / "gpt_oss_mxfp4"
    make_checkpoint("gpt_oss", source, overrides=dict(intermediate_size=64))
    shipped.mkdir()
    tensors = load_file(str(source / "model.safetensors"))
    expected = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4.quantize(tensors.pop(name).transpose(1, 2))  # (E, out, in)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        expected[name] = mxfp4.dequantize(blocks, scales).numpy()
    save_file(tensors, str(shipped / "model.safetensors"))
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            (shipped / file.name).write_bytes(file.read_bytes())

    def stays_mxfp4(gguf) -> None:
        for layer in [m for m in LLM(str(gguf), dtype="float32").engine.model.modules()
                      if isinstance(m, MoE)]:
            assert isinstance(layer.stored.gate_up, Mxfp4Stack)
            assert isinstance(layer.stored.down, Mxfp4Stack)

    gguf = export_gguf(shipped, tmp_path / "shipped.gguf", "f32")
    stored = {t.name: t for t in GGUFReader(str(gguf)).tensors}
    gate_up = expected["model.layers.0.mlp.experts.gate_up_proj"]  # gate, up rows interleaved
    for name, want in (("gate", gate_up[:, 0::2]), ("up", gate_up[:, 1::2]),
                       ("down", expected["model.layers.0.mlp.experts.down_proj"])):
        tensor = stored[f"blk.0.ffn_{name}_exps.weight"]
        assert tensor.tensor_type == GGMLQuantizationType.MXFP4
        assert np.array_equal(dequantize(np.asarray(tensor.data), tensor.tensor_type), want)
    stays_mxfp4(gguf)
    assert (logits(gguf) - logits(shipped)).abs().max() < 1e-5

    gguf = export_gguf(source, tmp_path / "mxfp4_moe.gguf", "mxfp4_moe")
    reference = tmp_path / "dequantized"
    reference.mkdir()
    convert(gguf, reference, dequantize_all=True)
    stays_mxfp4(gguf)
    want = logits(reference)
    assert (logits(gguf) - want).abs().max() < 3e-2 * want.abs().max()


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


@pytest.mark.parametrize("kind, bits", [("q5_k", {5}), ("q5_k_m", {5, 8})])
def test_5_bit_files_stay_5_bit_where_the_vnni_panels_serve(wide_moe, tmp_path, kind, bits,
                                                            monkeypatch):
    """Q5_K's codes held as stored (6 bits a weight, not int8's 8): the file's own values, up
    to the float16 scale and offset the W4A8 panels keep (Q5_K_M's Q6_K parts stay int8). The
    weights alone are compared: int8 held weight-only, and the prompt's rows on the dequantized
    panels as the built-in threshold puts them (a kernel plan may meet more rows as int8 rows,
    whose rounding tests/unit/test_panel_kernels.py holds the kernels to)."""
    from evenflow.engine.quant.panel_stack import w4a8_layout

    monkeypatch.setenv("EVENFLOW_NATIVE_INT8_ROWS", "0")
    monkeypatch.setenv("EVENFLOW_KERNEL_PLANS", "0")

    if not w4a8_layout(32, 256):
        pytest.skip("5-bit panels need AVX-512 VNNI")
    gguf = export_gguf(wide_moe, tmp_path / f"model-{kind}.gguf", kind)
    reference = tmp_path / "dequantized"
    reference.mkdir()
    convert(gguf, reference, dequantize_all=True)
    assert quantized_bits(LLM(str(gguf), dtype="float32")) == bits
    want = logits(reference)
    assert (logits(gguf) - want).abs().max() < 1e-2 * want.abs().max(), kind


def test_text_in_text_out_with_the_files_tokenizer(tmp_path):
    from evenflow.engine.weights.loader import model_directory as engine_resolve

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

    from evenflow.engine.weights.loader import model_directory as engine_resolve
    from evenflow.services.config import load_mesh_config

    source = engine_resolve("tiny-moe")
    gguf = export_gguf(source, tmp_path / "exported-q8.gguf", "q8_0")
    assert load_mesh_config({"model": str(gguf)}).model_name == "tiny-moe"
    assert load_mesh_config({"model": str(gguf), "served_model_name": "mine"}).model_name == "mine"
    served = json.loads((engine_resolve(str(gguf)) / "tokenizer_config.json").read_text())
    shipped = json.loads((source / "tokenizer_config.json").read_text())
    assert served["chat_template"] == shipped["chat_template"]
