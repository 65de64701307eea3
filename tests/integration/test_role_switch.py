"""Role switching through a real mesh (mock engine, a real NATS with per-service users): a
decode worker told to switch drains, hands its unfinished streams back (they finish elsewhere,
every token there), and serves prefill from the same process; not in place, it exits and the
launcher starts it again in the other role. The gateway routes by the new role at once, and a
switched worker that dies comes back in the role it served."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from tests.integration.meshutil import supervised_mesh, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mesh():
    from evenflow.services.config import MeshConfig

    config = MeshConfig(port=0, engine="mock", mock_timing_scale=4.0, num_prefill=1,
                        num_decode=2, num_ep_ranks=0, role_switching=True,
                        local_prefill_threshold=0, heartbeat_interval_s=0.2, num_gateways=1,
                        stats_log_interval_s=0, log_level="warning")
    with supervised_mesh(config) as mesh:
        yield mesh


def _live(mesh) -> dict[str, float]:
    text = httpx.get(mesh.url + "/metrics", timeout=10).text
    return {role: float(n) for role, n in
            re.findall(r'^evenflow_live_workers\{role="(\w+)"\} (\S+)$', text, re.M)}


def _roles(mesh) -> dict[str, str]:
    text = httpx.get(mesh.url + "/metrics", timeout=10).text
    found = re.findall(r'^evenflow_worker_role\{(.*)\} (\S+)$', text, re.M)
    labels = [(dict(re.findall(r'(\w+)="(\w+)"', inside)), v) for inside, v in found]
    return {d["worker"]: d["role"] for d, v in labels if float(v) == 1.0}


async def _switch(mesh, worker: str, to: str, in_place: bool, drain_s: float) -> None:
    from evenflow.proto import subjects
    from evenflow.proto.messages import RoleSwitch
    from evenflow.services.bus import Bus

    bus = Bus("test-operator")
    await bus.connect(mesh.admin_nats_url)
    try:
        await bus.publish(subjects.control(worker), RoleSwitch(
            worker_id=worker, to_role=to, drain_s=drain_s, in_place=in_place))
    finally:
        await bus.close()


async def _streams_across_a_switch(mesh, worker: str, to: str, in_place: bool
                                   ) -> list[int]:
    async with httpx.AsyncClient(base_url=mesh.url, timeout=120) as client:
        async def one(i: int) -> int:
            resp = await client.post("/v1/completions", json={
                "model": mesh.config.model_name, "prompt": [5 + i, 6, 7, 8] * 40,
                "max_tokens": 120, "ignore_eos": True})
            assert resp.status_code == 200, resp.text
            return resp.json()["usage"]["completion_tokens"]

        tasks = [asyncio.create_task(one(i)) for i in range(8)]
        await asyncio.sleep(0.8)  # (they run on both decode workers now)
        await _switch(mesh, worker, to, in_place, drain_s=0.3)
        return await asyncio.gather(*tasks)


def test_a_switch_in_place_loses_no_stream_and_the_gateway_routes_by_the_new_role(mesh):
    assert wait_for(lambda: _live(mesh) == {"prefill": 1.0, "decode": 2.0}, 20)
    tokens = asyncio.run(_streams_across_a_switch(mesh, "d1", "prefill", in_place=True))
    assert tokens == [120] * 8  # the streams handed back finished elsewhere, every token
    assert wait_for(lambda: _live(mesh) == {"prefill": 2.0, "decode": 1.0}, 20)
    assert _roles(mesh)["d1"] == "prefill"
    # and back, while nothing runs
    asyncio.run(_switch(mesh, "d1", "decode", in_place=True, drain_s=1))
    assert wait_for(lambda: _live(mesh) == {"prefill": 1.0, "decode": 2.0}, 20)
    assert _roles(mesh)["d1"] == "decode"


def test_a_switch_by_restart_comes_back_in_the_other_role(mesh):
    assert wait_for(lambda: _live(mesh) == {"prefill": 1.0, "decode": 2.0}, 20)
    tokens = asyncio.run(_streams_across_a_switch(mesh, "d0", "prefill", in_place=False))
    assert tokens == [120] * 8
    assert wait_for(lambda: _live(mesh) == {"prefill": 2.0, "decode": 1.0}, 60)
    assert _roles(mesh)["d0"] == "prefill"


def test_a_switched_worker_that_dies_comes_back_in_the_role_it_served(mesh):
    import signal

    # d0 runs as `evenflow.prefill` since the restart above; in place it goes back to decode
    assert wait_for(lambda: _roles(mesh).get("d0") == "prefill", 60)
    asyncio.run(_switch(mesh, "d0", "decode", in_place=True, drain_s=0.3))
    assert wait_for(lambda: _live(mesh) == {"prefill": 1.0, "decode": 2.0}, 20)
    (proc,) = [p for p in mesh.procs if p.poll() is None and str(p.args[-1]) == "d0"]
    proc.send_signal(signal.SIGKILL)
    assert wait_for(lambda: any(p.poll() is None and str(p.args[-1]) == "d0"
                                and p is not proc for p in mesh.procs), 30)
    (back,) = [p for p in mesh.procs if p.poll() is None and str(p.args[-1]) == "d0"]
    assert "evenflow.decode" in [str(a) for a in back.args]
    assert wait_for(lambda: _live(mesh) == {"prefill": 1.0, "decode": 2.0}, 30)
