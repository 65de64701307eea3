"""KV pulls through a real mesh (real NATS, Redis and tiny-moe engines): a chat's next turn,
routed to a prefill worker that lacks its history, pulls the history's blocks from the decode
worker that holds them instead of recomputing them, and answers exactly what recomputing
answers; a pull from a holder that died falls back to recomputing and the request completes."""

from __future__ import annotations

import concurrent.futures
import re
import signal
import time

import httpx
import pytest
import redis
from meshutil import running_mesh

from evenflow import LLM, SamplingParams
from evenflow.kv_index import store
from evenflow.proto.hashing import chain_hashes, namespace_salt
from evenflow.services.config import MeshConfig

pytestmark = pytest.mark.slow  # meshes of their own: ~30 s

MODEL = "tiny-moe"
HISTORY = [3 + (i * 7919) % 500 for i in range(40)]


def complete(mesh, prompt: list[int], max_tokens: int) -> dict:
    resp = httpx.post(mesh.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
        "temperature": 0, "logprobs": 0, "return_tokens_as_token_ids": True})
    assert resp.status_code == 200, resp.text
    return resp.json()


def token_ids(body: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]]


def worker_metric(mesh, worker_id: str, name: str, **labels: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{mesh.metrics_ports[worker_id]}/metrics").text
    label = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = "(?m)^" + re.escape(name) + (r"\{" + re.escape(label) + r"\}" if label else "") \
        + r" (\S+)"
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0


def config(**overrides) -> MeshConfig:
    settings = dict(model=MODEL, port=0, dtype="float32", num_prefill=1, num_decode=1,
                    local_prefill_threshold=0, kv_pull_min_tokens=16, num_ep_ranks=0,
                    num_threads=1, kv_cache_gb=0.05, heartbeat_interval_s=0.2)
    return MeshConfig(**{**settings, **overrides})


def test_next_turn_pulls_the_history_and_answers_as_recomputing_does():
    with running_mesh(config()) as mesh:
        answer = token_ids(complete(mesh, HISTORY, 80))
        turn2 = HISTORY + answer + [11, 12, 13, 14, 15, 16, 17, 18]
        time.sleep(1.0)  # the decode worker's KV events (the answer's blocks) reach the index
        body = complete(mesh, turn2, 12)
        pulled = worker_metric(mesh, "p0", "evenflow_kv_pulled_blocks_total")
        assert worker_metric(mesh, "p0", "evenflow_kv_pulls_total", outcome="pulled") == 1
        assert worker_metric(mesh, "d0", "evenflow_kv_pulls_served_total", what="pulls") == 1
    # p0 held the first turn's prompt (2 blocks of 16); the rest came from d0
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert pulled >= 4 and cached == (2 + pulled) * 16
    [expected] = LLM(MODEL, dtype="float32", num_threads=1).generate(
        [turn2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert token_ids(body) == expected.token_ids


def holder_of(mesh, block_hash: int) -> str:
    """The decode worker the index says holds this block."""
    keys = store.Keys(mesh.config.redis_prefix)
    members = redis.Redis.from_url(mesh.config.redis_url).smembers(keys.block_key(block_hash))
    [worker] = [m.decode().split("@")[0] for m in members if m.decode().startswith("d")]
    return worker


def test_a_holder_killed_during_the_pull_costs_a_recompute_not_the_request():
    cfg = config(num_decode=2, worker_timeout_s=1.5, kv_pull_timeout_s=1.0)
    with running_mesh(cfg) as mesh:
        answer = token_ids(complete(mesh, HISTORY, 80))
        turn2 = HISTORY + answer + [11, 12, 13, 14, 15, 16, 17, 18]
        time.sleep(1.0)  # the answer's blocks reach the index
        holder = holder_of(mesh, chain_hashes(turn2, 16, namespace_salt(MODEL))[5])
        proc = next(p for p in mesh.procs if p.args[-1] == holder)
        proc.send_signal(signal.SIGSTOP)  # frozen: the pull waits on it
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            turn = pool.submit(complete, mesh, turn2, 12)
            time.sleep(0.4)
            proc.send_signal(signal.SIGKILL)  # dies with the pull in flight
            body = turn.result(timeout=60)
        assert time.monotonic() - started < 30
        assert len(token_ids(body)) == 12
        assert worker_metric(mesh, "p0", "evenflow_kv_pulls_total", outcome="timeout") == 1
        assert worker_metric(mesh, "p0", "evenflow_kv_pulled_blocks_total") == 0
