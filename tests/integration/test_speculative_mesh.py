"""Speculative decoding through a real mesh (NATS, Redis, tiny-moe prefill and decode workers):
with speculative_config (`evenflow up --speculative-config`), a streamed greedy chat that copies
its prompt returns the text the offline engine gives without speculation, its usage reports its
accepted draft tokens, and the decode worker's metrics count them under vLLM's names."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from meshutil import running_mesh, wait_for

from evenflow import LLM, SamplingParams
from evenflow.services.config import MeshConfig

pytestmark = pytest.mark.slow  # a mesh of its own: ~20 s

MESSAGES = [{"role": "user", "content": "copy k 12 x to 40 hello please 3 4 5 a b c d 100 200"}]


def worker_metric(mesh, worker_id: str, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{mesh.metrics_ports[worker_id]}/metrics").text
    found = re.search("(?m)^" + re.escape(name) + r"(\{[^}]*\})? (\S+)", text)
    return float(found.group(2)) if found else 0.0


def test_a_streamed_greedy_chat_is_the_same_and_drafts_are_counted():
    offline = LLM("tiny-moe", dtype="float32").chat(
        MESSAGES, SamplingParams(temperature=0, max_tokens=24))
    config = MeshConfig(model="tiny-moe", port=0, dtype="float32", num_prefill=1, num_decode=1,
                        num_ep_ranks=0, num_threads=1, kv_cache_gb=0.05,
                        heartbeat_interval_s=0.2,
                        speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')
    with running_mesh(config) as mesh:
        body = {"model": "tiny-moe", "messages": MESSAGES, "max_tokens": 24, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        text, usage = "", None
        with httpx.stream("POST", mesh.url + "/v1/chat/completions", json=body,
                          timeout=60) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    chunk = json.loads(line[5:])
                    usage = chunk.get("usage") or usage
                    for choice in chunk["choices"]:
                        text += choice["delta"].get("content") or ""
        assert text == offline.text
        # the request's own drafts, as OpenAI reports predicted outputs
        details = usage["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] > 0
        assert details["rejected_prediction_tokens"] >= 0
        # (the worker exports its engine's counts with its gauges, every heartbeat)
        wait_for(lambda: worker_metric(mesh, "d0", "vllm:spec_decode_num_drafts_total") > 0,
                 timeout=10)
        accepted = worker_metric(mesh, "d0", "vllm:spec_decode_num_accepted_tokens_total")
        drafted = worker_metric(mesh, "d0", "vllm:spec_decode_num_draft_tokens_total")
        assert 0 < accepted <= drafted


def test_the_next_token_layer_drafts_after_the_nats_hand_off(tmp_path):
    """DeepSeek-V3 with its next-token layer, prefilled on p0 and decoded on d0: the prompt's
    last hidden states travel with its K/V over NATS, d0's layer drafts, and the text is the
    offline engine's without speculation."""
    from checkpoints import add_next_token_layer, make_checkpoint

    add_next_token_layer(tmp_path, make_checkpoint("deepseek_v3", tmp_path))
    prompt = " ".join(f"w{i}" for i in (5, 9, 33, 7, 101, 5, 9, 33, 12, 64, 200, 3))
    offline = LLM(str(tmp_path), dtype="float32").generate(
        [prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    config = MeshConfig(model=str(tmp_path), port=0, dtype="float32", num_prefill=1,
                        num_decode=1, num_ep_ranks=0, num_threads=1, kv_cache_gb=0.05,
                        heartbeat_interval_s=0.2,
                        speculative_config='{"method": "mtp", "num_speculative_tokens": 2}')
    with running_mesh(config) as mesh:
        body = {"model": config.model_name, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                "ignore_eos": True}
        resp = httpx.post(mesh.url + "/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == offline.text
        wait_for(lambda: worker_metric(mesh, "d0", "vllm:spec_decode_num_drafts_total") > 0,
                 timeout=10)
