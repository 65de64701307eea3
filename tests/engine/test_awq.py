"""AWQ checkpoints (AutoAWQ's GEMM layout; written here from that description, not by the code
under test) load into the engine's int4 with exactly their values, and generate what
transformers generates from the same weights dequantized."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from checkpoints import VOCAB, hf_greedy, make_checkpoint
from safetensors.torch import load_file, save_file

from evenflow import LLM, SamplingParams
from evenflow.engine.config.settings import ModelLoadError
from evenflow.engine.weights.quantize_model import QuantLinear

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
GROUP = 32
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds channel 8j + AWQ_ORDER[i]
LINEAR = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.\w+_proj"
                    r"|block_sparse_moe\.experts\.\d+\.w[123])\.weight$")


def pack(codes: torch.Tensor) -> torch.Tensor:
    """(R, N) codes 0..15 -> (R, N / 8) int32 in AWQ's order."""
    r, n = codes.shape
    words = torch.zeros(r, n // 8, dtype=torch.int64)
    grouped = codes.long().view(r, n // 8, 8)
    for i, channel in enumerate(AWQ_ORDER):
        words |= grouped[..., channel] << (4 * i)
    return words.to(torch.uint32).view(torch.int32) if hasattr(torch, "uint32") else \
        (words - (words >= 2**31) * 2**32).to(torch.int32)


def awq_linear(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(N, K) -> AWQ tensors (qweight, qzeros, scales) and the dequantized weight."""
    n, k = w.shape
    groups = w.float().T.reshape(k // GROUP, GROUP, n)  # (G, group, N): AWQ is input-major
    low, high = groups.amin(1), groups.amax(1)
    scale = ((high - low) / 15).clamp(min=1e-8).half()
    zero = torch.round(-low / scale.float()).clamp(0, 15)
    q = torch.round(groups / scale.float().unsqueeze(1) + zero.unsqueeze(1)).clamp(0, 15)
    dequantized = ((q - zero.unsqueeze(1)) * scale.float().unsqueeze(1)).reshape(k, n).T
    return {"qweight": pack(q.reshape(k, n)), "qzeros": pack(zero), "scales": scale}, \
        dequantized.contiguous()


def write_awq(path, oracle_dir) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    oracle = dict(tensors)
    for name in [n for n in tensors if LINEAR.search(n)]:
        parts, dequantized = awq_linear(tensors.pop(name))
        base = name.removesuffix(".weight")
        tensors.update({f"{base}.{suffix}": t for suffix, t in parts.items()})
        oracle[name] = dequantized
    shutil.copytree(path, oracle_dir)
    save_file(oracle, str(oracle_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": GROUP,
                                     "zero_point": True, "version": "gemm"}
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module", params=["qwen2", "mixtral"])
def awq_checkpoint(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp(f"{request.param}_awq")
    make_checkpoint(request.param, path)
    oracle_dir = tmp_path_factory.mktemp(f"{request.param}_awq_dequantized") / "model"
    write_awq(path, oracle_dir)
    hf = AutoModelForCausalLM.from_pretrained(oracle_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return path, hf


def test_awq_loads_as_int4_and_generates_what_transformers_generates(awq_checkpoint,
                                                                     monkeypatch):
    monkeypatch.setenv("EVENFLOW_NATIVE_W4A8", "0")  # the weights alone: rows at full precision
    path, hf = awq_checkpoint
    llm = LLM(str(path), dtype="float32", block_size=16)
    assert {m.weight_q.bits for m in llm.engine.model.modules()
            if isinstance(m, QuantLinear)} == {4}
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (7, 35)]
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, 16)


def test_awq_layouts_we_cannot_serve_are_named(tmp_path):
    make_checkpoint("qwen2", tmp_path / "m")
    write_awq(tmp_path / "m", tmp_path / "oracle")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["quantization_config"]["version"] = "gemv"
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="AWQ version 'gemv' is not supported"):
        LLM(str(tmp_path / "m"), dtype="float32")
