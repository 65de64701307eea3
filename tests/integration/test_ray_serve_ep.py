"""`evenflow up --ray --ep 2`: a DEP group is one Serve replica that launches its other rank; both
ranks serve as workers (/health lists them), a lost rank makes Ray replace the whole group, and
stopping leaves no rank process behind."""

from __future__ import annotations

import subprocess

import httpx
import pytest
from meshutil import wait_for

from evenflow.parallel.shm import SHM_DIR
from evenflow.services.config import MeshConfig
from evenflow.services.launcher import free_port

pytestmark = pytest.mark.slow


def ranks() -> list[str]:
    out = subprocess.run(["pgrep", "-af", "evenflow.decode d-"], capture_output=True,
                         text=True).stdout
    return [line.split()[-1] for line in out.splitlines() if "pgrep" not in line]


def complete(url: str) -> str | None:
    try:
        resp = httpx.post(url + "/v1/completions", timeout=30, json={
            "model": "tiny-moe", "prompt": "count from 17 :", "max_tokens": 6,
            "temperature": 0})
    except httpx.HTTPError:
        return None
    return resp.json()["choices"][0]["text"] if resp.status_code == 200 else None


def test_a_dep_group_is_one_replica_that_launches_its_ranks():
    pytest.importorskip("ray")
    from evenflow.rayserve.local import LocalRayMesh

    before = set(SHM_DIR.glob("evenflow-*"))
    mesh = LocalRayMesh(MeshConfig(port=free_port(), num_prefill=0, num_decode=1,
                                   expert_parallel_size=2, heartbeat_interval_s=0.5,
                                   worker_timeout_s=5.0))
    try:
        mesh.start(health_timeout_s=240)
        assert wait_for(lambda: httpx.get(mesh.url + "/health", timeout=5).json()["workers"]
                        .get("decode") == 2, timeout=60)
        assert complete(mesh.url) == " 17 18 19 20 21 22"
        (follower,) = ranks()  # rank 1, a child of the replica that runs rank 0
        assert follower.endswith("r1")
        subprocess.run(["pkill", "-9", "-f", f"evenflow.decode {follower}"])
        # Ray sees the replica unhealthy and replaces the group: new ids, serving again
        assert wait_for(lambda: ranks() and ranks() != [follower], timeout=120), ranks()
        assert wait_for(lambda: complete(mesh.url) == " 17 18 19 20 21 22", timeout=120)
    finally:
        mesh.stop()
        wait_for(lambda: not ranks(), timeout=30)
        # A rank 0 that Ray aborted (not stopped) leaves its group's segment: this test's go,
        # so that no later test finds them
        for leftover in set(SHM_DIR.glob("evenflow-*")) - before:
            leftover.unlink(missing_ok=True)
    assert not ranks()
