"""GPT-OSS's MXFP4 experts: a checkpoint whose experts are stored as real GPT-OSS checkpoints
store them (blocks + scales, quantization_config mxfp4) loads, and generates what transformers
generates from the same weights dequantized by transformers' own MXFP4 code."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import VOCAB, hf_greedy, make_checkpoint
from safetensors.torch import load_file, save_file

from evenflow import LLM, SamplingParams
from evenflow.engine.weights import mxfp4

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_dequantize_matches_transformers_and_round_trips():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 8, 2), generator=g, dtype=torch.uint8)
    ours = mxfp4.dequantize(blocks, scales)  # (E, out, in)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (E, in, out)
    assert torch.equal(ours, theirs.transpose(1, 2))
    again = mxfp4.dequantize(*mxfp4.quantize(ours))
    assert torch.equal(again, ours)  # representable values survive exactly


def test_quantize_error_is_bounded_by_the_group_scale():
    w = torch.randn(4, 16, 64)
    back = mxfp4.dequantize(*mxfp4.quantize(w))
    group_max = w.view(4, 16, 2, 32).abs().amax(-1, keepdim=True)
    # E2M1's largest step is 2 (between 4 and 6), at a scale that puts the max within 6
    assert ((back - w).view(4, 16, 2, 32).abs() <= group_max / 3 + 1e-6).all()


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
        blocks, scales = mxfp4.quantize(tensors.pop(name).transpose(1, 2))  # (E, out, in)
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


def test_mxfp4_gpt_oss_generates_what_transformers_generates(mxfp4_checkpoint):
    path, hf = mxfp4_checkpoint
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 33, 90)]
    llm = LLM(str(path), dtype="float32", block_size=16)
    for _ in range(2):  # the second pass hits the prefix cache
        outs = llm.generate(prompts, GREEDY)
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.token_ids == hf_greedy(hf, prompt, 24)
