"""The global KV index and KV-aware routing, on a mock-engine mesh (real block managers, real
KV events, real Redis and NATS): the index follows caches through store, evict and restart, a
dead worker leaves within its lease, bursts stick, and a Redis outage costs no request."""

from __future__ import annotations

import concurrent.futures
import re
import signal
import time

import httpx
import pytest
import redis
from meshutil import wait_for

from evenflow.kv_index import store
from evenflow.proto.hashing import chain_hashes, namespace_salt
from evenflow.services.config import MeshConfig
from evenflow.services.launcher import LocalMesh, start_redis

pytestmark = pytest.mark.slow  # meshes of their own, restarts: ~25 s

KEYS = store.Keys(MeshConfig().redis_prefix)  # the default mesh's Redis namespace

SALT = namespace_salt("tiny-moe")
BS = 16


@pytest.fixture
def kv_mesh():
    config = MeshConfig(port=0, engine="mock", num_prefill=2, num_decode=1, num_kv_blocks=128,
                        heartbeat_interval_s=0.2, worker_timeout_s=1.5,
                        local_prefill_threshold=0)
    mesh = LocalMesh(config)
    mesh.start(health_timeout_s=120)
    yield mesh
    mesh.stop()


def prompt(seed: int, length: int = 100) -> list[int]:
    return [3 + (seed * 7919 + i * 104729) % 500 for i in range(length)]


def complete(mesh, tokens, max_tokens=2):
    resp = httpx.post(mesh.url + "/v1/completions", timeout=30, json={
        "model": "tiny-moe", "prompt": tokens, "max_tokens": max_tokens, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return resp.json()


def holders(r: redis.Redis, block_hash: int) -> set[str]:
    return {m.decode() for m in r.smembers(KEYS.block_key(block_hash))}


def metric(mesh, name: str, **labels) -> float:
    text = httpx.get(mesh.url + "/metrics").text
    label = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(label) + r"\}" if label else "") + r" (\S+)"
    found = re.search(pattern, text)
    return float(found.group(1)) if found else 0.0


def test_index_follows_store_evict_and_restart(kv_mesh):
    r = redis.Redis.from_url(kv_mesh.config.redis_url)
    first = prompt(1)
    complete(kv_mesh, first)
    hashes = chain_hashes(first, BS, SALT)
    assert wait_for(lambda: len(holders(r, hashes[-1])) == 2)  # a prefill worker and d0
    members = holders(r, hashes[0])
    prefill_member = next(m for m in members if m.startswith("p"))
    # Evict: 128 blocks per worker; send other prompts to the same prefill worker until it
    # has to reuse the first prompt's blocks.
    worker = prefill_member.split("@")[0]
    for seed in range(2, 90):  # 6 full blocks each, spread over two workers of 128 blocks
        complete(kv_mesh, prompt(seed))
        if prefill_member not in holders(r, hashes[0]):
            break
    assert wait_for(lambda: prefill_member not in holders(r, hashes[0]))
    assert r.scard(KEYS.member_key(prefill_member)) <= 128  # it holds what its cache holds
    # Restart the worker: its old member is gone at once, the new one starts empty.
    proc = next(p for p in kv_mesh.procs if p.args[-1] == worker)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kv_mesh.procs.remove(proc)
    kv_mesh.spawn(["-m", "evenflow.prefill", worker])
    assert wait_for(lambda: not r.exists(KEYS.member_key(prefill_member)), timeout=10)


def test_killed_worker_leaves_within_its_lease(kv_mesh):
    r = redis.Redis.from_url(kv_mesh.config.redis_url)
    tokens = prompt(20)
    complete(kv_mesh, tokens)
    h = chain_hashes(tokens, BS, SALT)[0]
    assert wait_for(lambda: any(m.startswith("p") for m in holders(r, h)))
    member = next(m for m in holders(r, h) if m.startswith("p"))
    proc = next(p for p in kv_mesh.procs if p.args[-1] == member.split("@")[0])
    killed = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    assert wait_for(lambda: member not in holders(r, h), timeout=5)
    assert time.monotonic() - killed < kv_mesh.config.worker_timeout_s + 1.5
    complete(kv_mesh, tokens)  # routed to the live worker


@pytest.fixture
def sticky_mesh():
    config = MeshConfig(port=0, engine="mock", num_prefill=2, num_decode=1, num_kv_blocks=128,
                        heartbeat_interval_s=0.2, local_prefill_threshold=0,
                        kv_overlap_weight=2.0)  # reuse outweighs the in-flight load
    mesh = LocalMesh(config)
    mesh.start(health_timeout_s=120)
    yield mesh
    mesh.stop()


def test_burst_sharing_a_new_prefix_sticks_to_one_worker(sticky_mesh):
    kv_mesh = sticky_mesh
    shared = prompt(30, 160)
    before = metric(kv_mesh, "evenflow_routing_decisions_total", reason="kv_hit")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: complete(kv_mesh, shared + [5 + i] * 20), range(8)))
    hits = metric(kv_mesh, "evenflow_routing_decisions_total", reason="kv_hit") - before
    # The gateway opened its Redis connections at start: no first lookup timed out.
    assert metric(kv_mesh, "evenflow_routing_decisions_total", reason="redis_unavailable") == 0
    assert hits >= 6  # all but the first (and one spill-over under the load term) hit
    cached = [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs]
    # One worker computes the prefix once; a spill-over may compute it once more elsewhere.
    assert sum(1 for c in cached if c >= 160 - BS) >= 5
    # The hit rate is exported per worker that computed the prompt, with no synthetic total
    # (a sum() over the series would count it twice).
    name = "evenflow_cached_prompt_tokens_total"
    per_worker = [metric(kv_mesh, name, worker=w) for w in ("p0", "p1")]
    assert sum(per_worker) >= sum(cached)
    assert metric(kv_mesh, name, worker="all") == 0


@pytest.fixture(params=[False, True], ids=["redis-only", "local-copy"])
def outage_mesh(request):
    config = MeshConfig(port=0, engine="mock", num_prefill=2, num_decode=1, num_kv_blocks=128,
                        heartbeat_interval_s=0.2, worker_timeout_s=1.5,
                        local_prefill_threshold=0, kv_index_local_copy=request.param)
    mesh = LocalMesh(config)
    mesh.start(health_timeout_s=120)
    yield mesh
    mesh.stop()


def test_redis_outage_costs_no_request_and_the_index_recovers(outage_mesh):
    """Redis down: with Redis only, routing goes by load (`redis_unavailable`); with the
    gateway's own copy of the index, routing still finds the cached prefix. Either way no
    request fails, and Redis, back empty, is rebuilt from the workers' snapshots."""
    kv_mesh = outage_mesh
    local_copy = kv_mesh.config.kv_index_local_copy
    redis_server = next(s for s in kv_mesh.servers if s.kind == "redis")
    tokens = prompt(40)
    complete(kv_mesh, tokens)
    if local_copy:  # the copy syncs from the workers' snapshots within a few beats

        def routed_from_the_copy() -> bool:
            complete(kv_mesh, tokens)
            return metric(kv_mesh, "evenflow_kv_lookups_total", source="local") > 0

        assert wait_for(routed_from_the_copy, timeout=10)
    redis_server.stop()
    started = time.monotonic()
    hits = metric(kv_mesh, "evenflow_routing_decisions_total", reason="kv_hit")
    for seed in range(41, 45):
        complete(kv_mesh, prompt(seed))  # no request fails
    out = complete(kv_mesh, tokens)
    assert time.monotonic() - started < 10
    unavailable = metric(kv_mesh, "evenflow_routing_decisions_total", reason="redis_unavailable")
    if local_copy:
        assert unavailable == 0
        assert metric(kv_mesh, "evenflow_routing_decisions_total", reason="kv_hit") > hits
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    else:
        assert unavailable >= 5
    restarted = start_redis(redis_server.port)  # empty: the index must resync
    kv_mesh.servers[kv_mesh.servers.index(redis_server)] = restarted
    r = redis.Redis.from_url(restarted.url)
    h = chain_hashes(tokens, BS, SALT)[0]
    assert wait_for(lambda: len(holders(r, h)) >= 1, timeout=10)  # resynced from snapshots
    before = metric(kv_mesh, "evenflow_routing_decisions_total", reason="kv_hit")
    out = complete(kv_mesh, tokens)
    assert metric(kv_mesh, "evenflow_routing_decisions_total", reason="kv_hit") == before + 1
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
