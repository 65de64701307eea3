"""The balancer live on a local mesh with the default model: worker load in, a placement out,
applied by the workers between steps, acknowledged, stored in Redis; greedy text unchanged."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import httpx
import nats
import pytest
import redis
import torch
from meshutil import wait_for

from evenflow.balancer.service import placement_key
from evenflow.engine.model.placement import rank_balancedness
from evenflow.proto import subjects
from evenflow.proto.messages import ExpertLoad, ExpertPlacement, decode
from evenflow.services.config import MeshConfig
from evenflow.services.launcher import LocalMesh

PROMPTS = ["count from 17 :", "reverse : q w e r t =", "count down from 90 :",
           "count from 300 :", "reverse : a s d f =", "count from 123 :"]


@pytest.fixture
def ep_mesh():
    config = MeshConfig(port=0, num_prefill=1, num_decode=1, num_ep_ranks=4,
                        num_redundant_experts=4, eplb_report_interval_s=0.3,
                        eplb_min_interval_reports=4, eplb_window_reports=6, eplb_threshold=0.8)
    mesh = LocalMesh(config)
    mesh.start(health_timeout_s=180)
    yield mesh
    mesh.stop()


def complete(mesh, prompt):
    resp = httpx.post(mesh.url + "/v1/completions", timeout=60, json={
        "model": "tiny-moe", "prompt": prompt, "max_tokens": 20, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def observe(nats_url: str, seconds: float) -> tuple[list[ExpertLoad], list[ExpertPlacement]]:
    async def listen():
        nc = await nats.connect(nats_url)
        loads, placements = [], []

        async def on_load(msg):
            loads.append(decode(msg.data))

        async def on_placement(msg):
            placements.append(decode(msg.data))

        await nc.subscribe(subjects.EXPERT_LOAD, cb=on_load)
        await nc.subscribe(subjects.EXPERT_PLACEMENT, cb=on_placement)
        await asyncio.sleep(seconds)
        await nc.close()
        return loads, placements

    return asyncio.run(listen())


def test_balancer_pushes_a_placement_that_workers_apply(ep_mesh):
    before_text = [complete(ep_mesh, p) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        watcher = pool.submit(observe, ep_mesh.admin_nats_url, 12.0)
        deadline = time.monotonic() + 11
        while time.monotonic() < deadline:  # keep the experts busy
            for p in PROMPTS:
                complete(ep_mesh, p)
        loads, placements = watcher.result()
    placements = [p for p in placements if p.role == "decode"]  # a placement per role
    assert placements, "the balancer pushed no decode placement"
    newest = max(p.version for p in placements)
    applied = max((m.version for m in loads if m.worker_id == "d0" and sum(m.counts)), default=0)
    assert applied >= 1, "the decode worker never reported load under a pushed placement"
    acked = [m for m in loads if m.worker_id == "d0" and m.version == applied and sum(m.counts)]
    old = [m for m in loads if m.worker_id == "d0" and m.version == 0 and sum(m.counts)]
    shape = (acked[0].num_layers, acked[0].num_slots)
    def score(ms):
        return rank_balancedness(sum(torch.tensor(m.counts).view(shape) for m in ms), 4)
    if old:
        assert score(acked) > score(old)
    assert [complete(ep_mesh, p) for p in PROMPTS] == before_text  # greedy output unchanged
    r = redis.Redis.from_url(ep_mesh.config.redis_url)

    def stored_version() -> int:
        raw = r.get(MeshConfig().redis_prefix + placement_key("decode"))
        stored = decode(raw) if raw else None
        return stored.version if isinstance(stored, ExpertPlacement) else -1
    # Stored for a restarted balancer: the newest pushed (or a later one), never an older one.
    assert wait_for(lambda: stored_version() >= newest, timeout=5), stored_version()
