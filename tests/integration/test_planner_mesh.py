"""The planner through a real mesh (`evenflow up --planner`, mock engine): under a
prefill-heavy load on one prefill and two decode workers it switches a decode worker to
prefill, the gateway then routes to two prefill workers, and no request fails meanwhile; in
mode scale the launcher starts a prefill worker for the load instead, and stops it once the
load has gone."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from tests.integration.meshutil import supervised_mesh, wait_for

pytestmark = pytest.mark.slow


def _metric(url: str, name: str) -> dict[str, float]:
    text = httpx.get(url, timeout=10).text
    return {labels: float(v) for labels, v in re.findall(rf"^{name}\{{(.*)\}} (\S+)$", text,
                                                          re.M)}


async def _prefill_heavy_load(url: str, model: str, requests: int = 60) -> list[int]:
    """~4 prompts of 400 tokens a second (0.4 s each at the mock's scale): 1.6 prefill
    workers' worth."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(i: int) -> int:
            resp = await client.post("/v1/completions", json={
                "model": model, "prompt": [3 + i % 400] * 400, "max_tokens": 4,
                "ignore_eos": True})
            return resp.status_code

        tasks = []
        for i in range(requests):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(0.25)
        return await asyncio.gather(*tasks)


def test_the_planner_moves_a_worker_to_the_role_the_load_needs():
    from evenflow.services.config import MeshConfig

    config = MeshConfig(port=0, engine="mock", mock_timing_scale=10.0, num_prefill=1,
                        num_decode=2, num_ep_ranks=0, local_prefill_threshold=0,
                        planner=True, planner_interval_s=1.0, ttft_ms=600, itl_ms=200,
                        role_switch_drain_s=1.0, heartbeat_interval_s=0.2, num_gateways=1,
                        stats_log_interval_s=0, log_level="warning")
    with supervised_mesh(config) as mesh:
        codes = asyncio.run(_prefill_heavy_load(mesh.url, mesh.config.model_name))
        assert codes == [200] * len(codes)
        live = _metric(mesh.url + "/metrics", "evenflow_live_workers")
        assert live['role="prefill"'] == 2 and live['role="decode"'] == 1, live
        planner = _metric(mesh.metrics_urls()["plan0"], "evenflow_planner_decisions_total")
        assert planner.get('action="switch"', 0) >= 1, planner


def test_in_mode_scale_the_launcher_starts_and_stops_workers_for_the_load():
    from evenflow.services.config import MeshConfig

    config = MeshConfig(port=0, engine="mock", mock_timing_scale=10.0, num_prefill=1,
                        num_decode=1, num_ep_ranks=0, local_prefill_threshold=0,
                        planner=True, planner_mode="scale", max_workers=3,
                        planner_interval_s=1.0, ttft_ms=600, itl_ms=200,
                        heartbeat_interval_s=0.2, num_gateways=1, drain_timeout_s=5,
                        stats_log_interval_s=0, log_level="warning")
    with supervised_mesh(config) as mesh:
        codes = asyncio.run(_prefill_heavy_load(mesh.url, mesh.config.model_name))
        assert codes == [200] * len(codes)
        live = _metric(mesh.url + "/metrics", "evenflow_live_workers")
        assert live['role="prefill"'] == 2 and live['role="decode"'] == 1, live
        assert any(wid == "p1" for wid in mesh.metrics_urls())  # started by the launcher
        planner = _metric(mesh.metrics_urls()["plan0"], "evenflow_planner_decisions_total")
        assert planner.get('action="grow"', 0) >= 1, planner
        # idle: after its settling spell the planner shrinks prefill back to one worker
        assert wait_for(lambda: _metric(mesh.url + "/metrics", "evenflow_live_workers").get(
            'role="prefill"') == 1, timeout=40), "the idle fleet did not shrink"
        assert planner_decisions(mesh).get('action="shrink"', 0) >= 1


def planner_decisions(mesh) -> dict[str, float]:
    return _metric(mesh.metrics_urls()["plan0"], "evenflow_planner_decisions_total")
