"""`evenflow up --decode 1 --ep 2`: a DEP group of two decode ranks, each a worker of its own,
serves the API; kill -9 one rank mid-stream: the other rank leaves the group within 10 s, the
stream either moves to the group the supervisor brings back (the gateway waits
migration_wait_s for a decode worker) or ends with an error event, within a bound; no shm
segment is left, and the group serves again."""

from __future__ import annotations

import asyncio
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import nats
import pytest
from meshutil import supervised_mesh, wait_for
from test_tp_rank_death import stream

from evenflow.engine.config.families import load_model_config
from evenflow.engine.weights.loader import model_directory
from evenflow.parallel.shm import SHM_DIR
from evenflow.proto import subjects
from evenflow.proto.messages import ExpertLoad, ExpertPlacement, decode, encode
from evenflow.services.config import MeshConfig
from evenflow.services.launcher import LocalMesh

pytestmark = pytest.mark.slow
RANKS = {"d0r0", "d0r1", "p0r0", "p0r1"}


@pytest.fixture(scope="module")
def ep_mesh():
    config = MeshConfig(port=0, num_prefill=1, num_decode=1, expert_parallel_size=2,
                        heartbeat_interval_s=0.2, worker_timeout_s=2.0)
    try:
        with supervised_mesh(config) as mesh:
            yield mesh
    finally:
        assert not [p.name for p in SHM_DIR.iterdir() if p.name.startswith("evenflow-")]


def worker(mesh: LocalMesh, name: str):
    return next(p for p in mesh.procs if p.args[-1] == name)


def test_the_group_serves_and_health_counts_every_rank(ep_mesh):
    health = httpx.get(ep_mesh.url + "/health", timeout=10).json()
    assert health["workers"] == {"prefill": 2, "decode": 2}
    text, tokens, error = stream(ep_mesh, "count from 17 : 17 18")
    assert error is None and tokens == 200 and text.split()[:4] == ["19", "20", "21", "22"]


def complete(mesh: LocalMesh, prompt: str) -> str:
    resp = httpx.post(mesh.url + "/v1/completions", timeout=60, json={
        "model": "tiny-moe", "prompt": prompt, "max_tokens": 16, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def test_a_pushed_placement_moves_experts_and_keeps_the_text(ep_mesh):
    prompts = ["count from 17 :", "reverse : q w e r t =", "count down from 90 :"]
    before = [complete(ep_mesh, p) for p in prompts]
    cfg = load_model_config(model_directory("tiny-moe"))
    layers, experts = cfg.num_moe_layers, cfg.num_experts
    slots = experts + ep_mesh.config.num_redundant_experts
    row = [(slots - 1 - s) % experts for s in range(slots)]  # experts change ranks
    version = 1000  # above anything the mesh's own balancer pushes meanwhile
    loads: list[ExpertLoad] = []

    async def push_and_watch() -> None:
        nc = await nats.connect(ep_mesh.admin_nats_url)

        async def on_load(msg) -> None:
            loads.append(decode(msg.data))

        await nc.subscribe(subjects.EXPERT_LOAD, cb=on_load)
        bad = ExpertPlacement(version=version + 1, num_layers=layers, num_slots=experts,
                              phy2log=list(range(experts)) * layers,
                              shares=[1.0] * layers * experts)
        await nc.publish(subjects.EXPERT_PLACEMENT, encode(bad))  # wrong shape: refused
        await nc.publish(subjects.EXPERT_PLACEMENT, encode(ExpertPlacement(
            version=version, num_layers=layers, num_slots=slots, phy2log=row * layers,
            shares=[1.0] * (layers * slots))))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and {m.worker_id for m in loads
                                               if m.version == version} < RANKS:
            await asyncio.sleep(0.1)
        await nc.close()

    asyncio.run(push_and_watch())
    assert {m.worker_id for m in loads if m.version == version} >= RANKS
    assert [complete(ep_mesh, p) for p in prompts] == before  # greedy text unchanged
    # each rank's load reports carry its role, group and step timings (the first prompts ran
    # just before the reports were taken)
    timed = [m for m in loads if m.steps]
    assert {m.worker_id for m in timed} & {"d0r0", "d0r1"}, loads
    assert all(m.group and m.role in ("prefill", "decode") and m.step_s > 0
               and m.moe_compute_s > 0 and m.moe_wait_s > 0 for m in timed)


def test_killing_a_rank_ends_the_group_and_it_comes_back(ep_mesh):
    rank0, rank1 = worker(ep_mesh, "d0r0"), worker(ep_mesh, "d0r1")
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(stream, ep_mesh, "count from 5 : 5 6 7")
        time.sleep(1.5)
        rank1.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        assert wait_for(lambda: rank0.poll() is not None, timeout=10), "rank 0 stayed"
        _, tokens, error = pending.result(timeout=60)
        # (bounded: the heartbeat timeout, the wait for a decode worker, the rest of the stream)
        assert time.monotonic() - killed < 10 + ep_mesh.config.migration_wait_s + 10
    assert error is not None or tokens == 200  # an error event, never a silent cut
    assert wait_for(lambda: worker(ep_mesh, "d0r0").pid != rank0.pid
                    and worker(ep_mesh, "d0r1").pid != rank1.pid, timeout=15)
    assert wait_for(lambda: stream(ep_mesh, "count from 9 : 9 10")[2] is None, timeout=90)
