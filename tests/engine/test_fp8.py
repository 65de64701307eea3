"""FP8 block-wise checkpoints (DeepSeek-V3/R1's and Qwen3-FP8's form: float8_e4m3fn weights, a
float32 `weight_scale_inv` per 128 x 128 tile; written here from that description, not by the
code under test) load with their weights kept at a byte each, and generate what transformers
generates from the same weights dequantized."""

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
from evenflow.engine.quant import forms
from evenflow.engine.quant.fp8 import Fp8Stack
from evenflow.engine.quant.panel_stack import PanelStack

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
TILE = 128
# The linear layers FP8 checkpoints quantize (DeepSeek-V3's modules_to_not_convert leaves the
# embedding, norms, router gate and lm_head in bf16)
QUANTIZED = re.compile(r"\.(self_attn\.\w+_proj|mlp\.(?:.+\.)?(?:gate|up|down)_proj)\.weight$")


def spec_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> (fp8 (N, K), scale_inv (ceil(N/128), ceil(K/128))): per tile, scale_inv =
    amax / 448 (e4m3's largest), q = w / scale_inv rounded to e4m3."""
    n, k = w.shape
    rows, cols = -(-n // TILE), -(-k // TILE)
    scale = torch.empty(rows, cols)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * TILE:(i + 1) * TILE, j * TILE:(j + 1) * TILE].float()
            s = max(tile.abs().max().item(), 1e-12) / 448.0
            scale[i, j] = s
            q[i * TILE:(i + 1) * TILE, j * TILE:(j + 1) * TILE] = (tile / s).to(torch.float8_e4m3fn)
    return q, scale


def dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    per = scale.repeat_interleave(TILE, 0)[:n].repeat_interleave(TILE, 1)[:, :k]
    return q.float() * per


def write_fp8(path, oracle_dir=None) -> int:
    """Rewrite the checkpoint at `path` in FP8 block-wise form (and, in `oracle_dir`, the same
    checkpoint with those weights dequantized, for transformers); returns how many layers were
    converted."""
    tensors = load_file(str(path / "model.safetensors"))
    oracle = dict(tensors)
    converted = 0
    for name in [n for n in tensors if QUANTIZED.search(n) and tensors[n].dim() == 2]:
        q, scale = spec_fp8(tensors[name])
        tensors[name] = q
        tensors[name.removesuffix(".weight") + ".weight_scale_inv"] = scale
        oracle[name] = dequantized(q, scale)
        converted += 1
    config = json.loads((path / "config.json").read_text())
    if oracle_dir is not None:
        shutil.copytree(path, oracle_dir)
        save_file(oracle, str(oracle_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [TILE, TILE]}
    (path / "config.json").write_text(json.dumps(config))
    return converted


@pytest.fixture(scope="module", params=["deepseek_v3", "qwen3_moe"])
def fp8_checkpoint(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp(f"{request.param}_fp8")
    make_checkpoint(request.param, path)
    oracle_dir = tmp_path_factory.mktemp(f"{request.param}_dequantized") / "model"
    assert write_fp8(path, oracle_dir) > 0
    hf = AutoModelForCausalLM.from_pretrained(oracle_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return path, hf


@pytest.mark.parametrize("form", ["native", "fallback"])
def test_fp8_checkpoint_stays_fp8_and_generates_what_transformers_generates(
        fp8_checkpoint, form, monkeypatch):
    """native: fp8 panels where the panel kernels serve (AVX-512), else the fallback; fallback:
    the torch stack (dequantized per call) everywhere."""
    if form == "fallback":
        monkeypatch.setattr(forms, "usable", lambda *args, **kwargs: False)
    path, hf = fp8_checkpoint
    llm = LLM(str(path), dtype="float32", block_size=16)
    stacks = [m.weight_q for m in llm.engine.model.modules() if hasattr(m, "weight_q")]
    stacks += [s for m in llm.engine.model.modules() if getattr(m, "stored", None) is not None
               for s in (m.stored.gate_up, m.stored.down)]
    assert stacks and all(isinstance(s, (Fp8Stack, PanelStack)) for s in stacks)
    if form == "fallback":
        assert all(isinstance(s, Fp8Stack) for s in stacks)
    for s in stacks:  # a byte a weight, and a float32 scale per channel and 128 inputs
        assert (s.values if isinstance(s, Fp8Stack) else s.data[0]).dtype == torch.float8_e4m3fn
        weights = s.num * s.out_features * s.in_features
        assert s.nbytes() == weights + 4 * s.num * s.out_features * -(-s.in_features // 128)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (6, 40)]
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, 20)


@pytest.mark.parametrize("change, message", [
    ({"weight_block_size": None}, "per-tensor FP8 is not"),
    ({"weight_block_size": [64, 64]}, "weight_block_size [64, 64]"),
    ({"fmt": "e5m2"}, "'e5m2' are not supported"),
])
def test_fp8_variants_we_cannot_serve_are_named(tmp_path, change, message):
    make_checkpoint("qwen3_moe", tmp_path)
    write_fp8(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        LLM(str(tmp_path), dtype="float32")
