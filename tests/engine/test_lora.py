"""LoRA adapters (engine/model/lora.py) against transformers + PEFT in float32: a random Mixtral
and two PEFT adapters written by PEFT itself (attention q/k/v/o, and per-expert factors on the
fused experts through `target_parameters`); the base model and both adapters in one batch each
generate what PEFT generates; the same prompt under two adapters shares no cached block; a
request's adapter travels with its prefill -> decode hand-off; the batch holds at most
max_loras adapters; adapters evenflow cannot serve are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import (
    VOCAB,
    hf_greedy,
    make_checkpoint,
    prefill_then_decode,
    write_peft_adapter,
)

from evenflow import SamplingParams
from evenflow.engine.serving.engine import Engine, EngineConfig

NEW = 12


def _adapter(hf, path, seed: int, targets: list[str], parameters: list[str]) -> None:
    write_peft_adapter(hf, path, seed, targets, parameters, rank=4, gain=3.0)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora")
    make_checkpoint("mixtral", root / "base")

    def fresh():
        hf = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        return hf

    _adapter(fresh(), root / "a", 1, ["q_proj", "v_proj", "o_proj"],
             ["experts.gate_up_proj", "experts.down_proj"])
    _adapter(fresh(), root / "b", 2, ["k_proj", "o_proj"], ["experts.down_proj"])
    oracles = {"": fresh()}
    for name in ("a", "b"):
        oracles[name] = PeftModel.from_pretrained(fresh(), root / name).eval()
    return root, oracles


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _params(root, name: str) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, lora_name=name,
                          lora_path=str(root / name) if name else "")


def _run(engine: Engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for step in engine.step():
            out.setdefault(step.request_id, []).extend(step.new_token_ids)
    return out


def test_base_and_two_adapters_in_one_batch_match_peft(mixtral):
    root, oracles = mixtral
    prompts = {"": _prompt(9, 1), "a": _prompt(13, 2), "b": _prompt(6, 3)}
    expected = {name: hf_greedy(oracles[name], p, NEW) for name, p in prompts.items()}
    assert len({tuple(t) for t in expected.values()}) == 3
    assert hf_greedy(oracles[""], prompts["a"], NEW) != expected["a"]  # the adapter matters
    engine = Engine(EngineConfig(model=str(root / "base"), dtype="float32", block_size=4))
    for name, prompt in prompts.items():
        engine.add_request(name or "base", prompt, _params(root, name))
    out = _run(engine)
    assert {name: out[name or "base"] for name in prompts} == expected
    # one prompt under all three, again batched together
    same = _prompt(11, 4)
    for name in ("", "a", "b"):
        engine.add_request(f"same-{name}", same, _params(root, name))
    out = _run(engine)
    for name in ("", "a", "b"):
        assert out[f"same-{name}"] == hf_greedy(oracles[name], same, NEW), name


def test_the_same_prompt_under_two_adapters_shares_no_cached_block(mixtral):
    root, _ = mixtral
    engine = Engine(EngineConfig(model=str(root / "base"), dtype="float32", block_size=4))
    prompt = _prompt(17, 5)
    cached = {}
    for rid, name in (("a1", "a"), ("b1", "b"), ("a2", "a"), ("base", "")):
        engine.add_request(rid, prompt, _params(root, name))
        while engine.has_unfinished():
            for step in engine.step():
                if step.finished:
                    cached[rid] = step.num_cached_tokens
    assert cached["a2"] == 16  # its own adapter's blocks
    assert cached["b1"] == cached["base"] == 0  # never another adapter's


def test_the_adapter_travels_with_the_prefill_to_decode_hand_off(mixtral):
    root, oracles = mixtral
    config = EngineConfig(model=str(root / "base"), dtype="float32", block_size=4)
    prompt = _prompt(10, 6)
    single, handed, _ = prefill_then_decode(config, {"r": prompt}, _params(root, "a"))
    assert single["r"] == handed["r"] == hf_greedy(oracles["a"], prompt, NEW)


def test_at_most_max_loras_adapters_share_a_step(mixtral):
    root, _ = mixtral
    engine = Engine(EngineConfig(model=str(root / "base"), dtype="float32", block_size=4,
                                 max_loras=1))
    engine.add_request("a", _prompt(5, 7), _params(root, "a"))
    engine.add_request("b", _prompt(5, 8), _params(root, "b"))
    engine.step()
    running = {s.params.lora_name for s in engine.scheduler.running}
    assert running == {"a"}  # b waits for a's adapter to leave the batch
    assert set(_run(engine)) == {"a", "b"}


def test_adapters_that_cannot_be_served_are_refused_by_name(mixtral, tmp_path):
    root, _ = mixtral
    engine = Engine(EngineConfig(model=str(root / "base"), dtype="float32", block_size=4))
    with pytest.raises(ValueError, match="cannot read a PEFT checkpoint"):
        engine.add_request("x", [3, 4], _params(tmp_path, "missing"))
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((root / "a" / "adapter_config.json").read_text()) | {"use_dora": True}
    (dora / "adapter_config.json").write_text(json.dumps(config))
    (dora / "adapter_model.safetensors").write_bytes(
        (root / "a" / "adapter_model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="use_dora"):
        engine.add_request("y", [3, 4], _params(tmp_path, "dora"))


def test_dense_mlp_and_shared_expert_adapters_match_peft(tmp_path):
    """Qwen2-MoE: a dense MLP layer and a MoE layer's shared expert, adapted."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    make_checkpoint("qwen2_moe", tmp_path / "base")

    def fresh():
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        return hf

    _adapter(fresh(), tmp_path / "m", 5, ["q_proj", "gate_proj", "up_proj", "down_proj"], [])
    oracle = PeftModel.from_pretrained(fresh(), tmp_path / "m").eval()
    engine = Engine(EngineConfig(model=str(tmp_path / "base"), dtype="float32", block_size=4))
    prompts = {"": _prompt(8, 9), "m": _prompt(12, 10)}
    for name, prompt in prompts.items():
        engine.add_request(name or "base", prompt, _params(tmp_path, name))
    out = _run(engine)
    assert out["m"] == hf_greedy(oracle, prompts["m"], NEW) != hf_greedy(fresh(), prompts["m"],
                                                                           NEW)
    assert out["base"] == hf_greedy(fresh(), prompts[""], NEW)
