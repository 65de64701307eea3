"""GPT-OSS's MXFP4 experts: a checkpoint whose experts are stored as real GPT-OSS checkpoints
store them (blocks + scales, quantization_config mxfp4; written here from the OCP spec, not by
the code under test) loads with its experts kept at 4.25 bits a weight, and generates what
transformers generates from the same weights dequantized by transformers' own MXFP4 code."""

from __future__ import annotations

import json
import math

import pytest
import torch
from checkpoints import VOCAB, hf_greedy, make_checkpoint
from safetensors.torch import load_file, save_file

from evenflow import LLM, SamplingParams
from evenflow.engine.model.moe import MoE
from evenflow.engine.quant import mxfp4
from evenflow.engine.quant.mxfp4 import Mxfp4Stack
from evenflow.engine.quant.panel_stack import PanelStack
from evenflow.engine.runners.model_runner import ChunkInput

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # OCP MX spec, FP4 E2M1


def spec_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., out, in) float -> (blocks (..., out, in/32, 16), scales (..., out, in/32)) by the
    OCP Microscaling spec: a block of 32 shares X = 2^(floor(log2(amax)) - emax_elem), emax_elem
    = 2 for E2M1; each element is P = round-to-nearest(V / X) in E2M1 (saturating at 6); codes
    pack two a byte, the first element in the low nibble; the scale byte is log2(X) + 127."""
    *lead, k = w.shape
    flat = w.float().reshape(-1, 32)
    blocks, scales = [], []
    for row in flat.tolist():
        amax = max(abs(v) for v in row)
        exponent = (math.floor(math.log2(amax)) - 2) if amax > 0 else -127
        x = 2.0 ** exponent
        codes = []
        for v in row:
            mag = min(E2M1_MAGNITUDES, key=lambda m, v=v: abs(abs(v) / x - m))
            codes.append(E2M1_MAGNITUDES.index(mag) | (8 if v < 0 else 0))
        blocks.append([codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(16)])
        scales.append(exponent + 127)
    return (torch.tensor(blocks, dtype=torch.uint8).reshape(*lead, k // 32, 16),
            torch.tensor(scales, dtype=torch.uint8).reshape(*lead, k // 32))


def test_dequantize_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 8, 2), generator=g, dtype=torch.uint8)
    ours = mxfp4.dequantize(blocks, scales)  # (E, out, in)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (E, in, out)
    assert torch.equal(ours, theirs.transpose(1, 2))
    # the spec's writer, read back: every element within half a step of E2M1 at its scale
    w = torch.randn(2, 4, 64)
    back = mxfp4.dequantize(*spec_mxfp4(w))
    group_max = w.view(2, 4, 2, 32).abs().amax(-1, keepdim=True)
    assert ((back - w).view(2, 4, 2, 32).abs() <= group_max / 4 + 1e-6).all()


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """A random GPT-OSS saved by transformers, its experts then rewritten as MXFP4; the oracle
    is transformers' model with the experts transformers dequantizes from those bytes."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    hf = make_checkpoint("gpt_oss", path, overrides=dict(intermediate_size=64))
    tensors = load_file(str(path / "model.safetensors"))
    dequantized = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = spec_mxfp4(tensors.pop(name).transpose(1, 2))  # (E, out, in)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["router", "self_attn", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    assert not hf.load_state_dict(dequantized, strict=False).unexpected_keys
    hf.generation_config.eos_token_id = None
    return path, hf


def expert_stacks(llm: LLM) -> list:
    layers = [m for m in llm.engine.model.modules() if isinstance(m, MoE)]
    assert layers and all(m.stored is not None for m in layers)
    return [s for m in layers for s in (m.stored.gate_up, m.stored.down)]  # type: ignore[union-attr]


def test_mxfp4_experts_stay_mxfp4_and_generate_what_transformers_generates(
        mxfp4_checkpoint, monkeypatch):
    monkeypatch.setenv("EVENFLOW_NATIVE_W4A8", "0")  # the torch fallback: exact dequantization
    path, hf = mxfp4_checkpoint
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 33, 90)]
    llm = LLM(str(path), dtype="float32", block_size=16)
    for stack in expert_stacks(llm):
        assert isinstance(stack, Mxfp4Stack)
        weights = stack.num * stack.out_features * stack.in_features
        assert stack.nbytes() * 8 == weights * 4.25  # as shipped: 4 bits + a byte per 32
    for _ in range(2):  # the second pass hits the prefix cache
        outs = llm.generate(prompts, GREEDY)
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.token_ids == hf_greedy(hf, prompt, 24)


def test_mxfp4_panels_on_vnni_compute_the_checkpoints_model(mxfp4_checkpoint):
    """Where the W4A8 kernel serves, the experts are MXFP4 panels (4.25 bits a weight) and
    few rows meet them quantized per group: logits agree with transformers' to that rounding
    (a wrongly read code or exponent moves them by far more)."""
    path, hf = mxfp4_checkpoint
    llm = LLM(str(path), dtype="float32", block_size=16)
    stacks = expert_stacks(llm)
    if not isinstance(stacks[0], PanelStack):
        pytest.skip("the MXFP4 panel kernel needs AVX-512 VNNI")
    for stack in stacks:
        weights = stack.num * stack.out_features * stack.in_features
        assert stack.nbytes() * 8 == weights * 4.25
    prompt = list(range(3, 40))
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    for rows in (prompt, prompt[:4]):  # prefill (dequantized panels) and few rows (W4A8)
        blocks = list(range(-(-len(rows) // 16)))
        got = llm.engine.runner.forward([ChunkInput(rows, 0, blocks, True, every_row=True)])
        ref = want[: len(rows)]
        assert (got - ref).abs().max() < 3e-2 * ref.abs().max()
