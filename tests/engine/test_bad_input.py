"""Bad checkpoints and bad requests raise clear errors naming the problem, before any forward."""

from __future__ import annotations

import json

import pytest
from checkpoints import make_checkpoint

from evenflow import LLM, SamplingParams
from evenflow.engine.config.settings import ModelLoadError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    make_checkpoint("mixtral", path)
    return path


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), dtype="float32", max_model_len=64)


def copy_of(ckpt, tmp_path):
    for f in ckpt.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    return tmp_path


def test_unknown_architecture(ckpt, tmp_path):
    path = copy_of(ckpt, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel"):
        LLM(str(path))


@pytest.mark.parametrize("arch, why", [("Qwen3NextForCausalLM", "linear-attention"),
                                       ("DeepseekV32ForCausalLM", "sparse attention")])
def test_a_refused_family_says_why(ckpt, tmp_path, arch, why):
    path = copy_of(ckpt, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = [arch]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=f"{arch} is not supported.*{why}"):
        LLM(str(path))


def test_missing_and_corrupt_files(ckpt, tmp_path):
    with pytest.raises(ModelLoadError, match="neither a built-in model nor a directory"):
        LLM(str(tmp_path / "nowhere"))
    path = copy_of(ckpt, tmp_path)
    (path / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelLoadError, match="corrupt or unreadable"):
        LLM(str(path))
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLM(str(path))
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        LLM(str(path))


def test_missing_tensor_is_named(ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    path = copy_of(ckpt, tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.post_attention_layernorm.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="lacks"):
        LLM(str(path))


def test_bad_requests(llm):
    with pytest.raises(ValueError, match="context holds 64"):
        llm.generate([[5] * 64])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 100000]])
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    # Nothing is left behind: the engine still serves.
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    assert not llm.engine.has_unfinished()


def test_generation_stops_at_the_context_limit(llm):
    out = llm.generate([[5] * 60], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"
