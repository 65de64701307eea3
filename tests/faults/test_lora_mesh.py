"""LoRA adapters through the mesh (`evenflow up --lora-modules`, the built-in tiny-moe, two PEFT
adapters written by PEFT): both are listed and served, their answers differ from the base
model's, the official openai client selects one by "model"; an adapter loaded at run time is
served and, unloaded, is a 404; and a stream of an adapter survives the death of the decode
worker serving it (it migrates with its adapter: the new worker loads it by path)."""

from __future__ import annotations

import signal

import httpx
import orjson
import pytest
import torch
from meshutil import running_mesh
from test_deterministic_migration import busy_decode_worker

from evenflow.services.config import MeshConfig

pytestmark = pytest.mark.slow

PROMPT = "count from 200 : " + " ".join(map(str, range(200, 214)))


def _write_adapter(path, seed: int, targets: list[str], parameters: list[str]) -> None:
    from checkpoints import write_peft_adapter
    from transformers import AutoModelForCausalLM

    from evenflow import models

    hf = AutoModelForCausalLM.from_pretrained(models.resolve_model("tiny-moe"),
                                              dtype=torch.float32)
    write_peft_adapter(hf, path, seed, targets, parameters, rank=8, gain=4.0)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("adapters")
    _write_adapter(root / "a", 1, ["q_proj", "v_proj", "o_proj"],
                   ["experts.gate_up_proj", "experts.down_proj"])
    _write_adapter(root / "b", 2, ["k_proj", "o_proj"], [])
    _write_adapter(root / "c", 3, ["q_proj"], ["experts.down_proj"])
    return root


@pytest.fixture(scope="module")
def mesh(adapters):
    config = MeshConfig(port=0, num_prefill=1, num_decode=2, num_gateways=1,
                        lora_modules=(f"a={adapters / 'a'}", f"b={adapters / 'b'}"),
                        heartbeat_interval_s=0.2, worker_timeout_s=1.5, migration_wait_s=5.0,
                        debug_step_delay_ms="8")  # a stream of a few seconds: time to kill
    with running_mesh(config, health_timeout_s=180) as running:
        yield running


def _complete(mesh, model: str, max_tokens: int = 24) -> httpx.Response:
    return httpx.post(mesh.url + "/v1/completions", timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True})


def test_both_adapters_are_listed_and_served(mesh):
    from openai import OpenAI

    models = httpx.get(mesh.url + "/v1/models", timeout=10).json()["data"]
    assert {m["id"]: m["parent"] for m in models} == {"tiny-moe": None, "a": "tiny-moe",
                                                       "b": "tiny-moe"}
    texts = {}
    for model in ("tiny-moe", "a", "b"):
        resp = _complete(mesh, model)
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == model and resp.json()["usage"]["completion_tokens"] == 24
        texts[model] = resp.json()["choices"][0]["text"]
    assert texts["a"] != texts["tiny-moe"] and texts["b"] != texts["tiny-moe"]
    client = OpenAI(base_url=mesh.url + "/v1", api_key="none", max_retries=0)
    chat = client.chat.completions.create(model="b", max_tokens=5, temperature=0, messages=[
        {"role": "user", "content": "hi"}])
    assert chat.model == "b" and chat.choices[0].finish_reason in ("stop", "length")


def test_an_adapter_loaded_at_run_time_is_served_until_unloaded(mesh, adapters):
    url = mesh.url
    bad = httpx.post(url + "/v1/load_lora_adapter", timeout=10,
                     json={"lora_name": "x", "lora_path": str(adapters / "missing")})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    ok = httpx.post(url + "/v1/load_lora_adapter", timeout=10,
                    json={"lora_name": "c", "lora_path": str(adapters / "c")})
    assert ok.status_code == 200, ok.text
    again = httpx.post(url + "/v1/load_lora_adapter", timeout=10,
                       json={"lora_name": "c", "lora_path": str(adapters / "c")})
    assert again.status_code == 400
    assert "c" in {m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]}
    assert _complete(mesh, "c").status_code == 200
    assert httpx.post(url + "/v1/unload_lora_adapter", timeout=10,
                      json={"lora_name": "c"}).status_code == 200
    gone = _complete(mesh, "c")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert httpx.post(url + "/v1/unload_lora_adapter", timeout=10,
                      json={"lora_name": "c"}).status_code == 404


def test_an_adapters_stream_survives_its_decode_workers_death(mesh):
    body = {"model": "a", "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    pieces, error, killed, usage = [], None, None, None
    with httpx.stream("POST", mesh.url + "/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line.removeprefix("data: "))
            if "error" in event:
                error = event["error"]
                continue
            if event["choices"]:
                pieces.append(event["choices"][0]["text"])
            usage = event.get("usage") or usage
            if killed is None and len(pieces) == 60:
                killed = busy_decode_worker(mesh)
                next(p for p in mesh.procs if p.args[-1] == killed).send_signal(signal.SIGKILL)
    assert killed is not None and error is None, error
    assert usage["completion_tokens"] == 300  # every token, after the move
