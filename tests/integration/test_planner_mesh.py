"""The planner through a real mesh (`evenflow up --planner`, mock engine): under a
prefill-heavy load on one prefill and two decode workers it switches a decode worker to
prefill, the gateway then routes to two prefill workers, and no request fails meanwhile."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from tests.integration.meshutil import supervised_mesh

pytestmark = pytest.mark.slow


def _metric(url: str, name: str) -> dict[str, float]:
    text = httpx.get(url, timeout=10).text
    return {labels: float(v) for labels, v in re.findall(rf"^{name}\{{(.*)\}} (\S+)$", text,
                                                          re.M)}


def test_the_planner_moves_a_worker_to_the_role_the_load_needs():
    from evenflow.services.config import MeshConfig

    config = MeshConfig(port=0, engine="mock", mock_timing_scale=10.0, num_prefill=1,
                        num_decode=2, num_ep_ranks=0, local_prefill_threshold=0,
                        planner=True, planner_interval_s=1.0, ttft_ms=600, itl_ms=200,
                        role_switch_drain_s=1.0, heartbeat_interval_s=0.2, num_gateways=1,
                        stats_log_interval_s=0, log_level="warning")
    with supervised_mesh(config) as mesh:
        async def load() -> list[int]:
            async with httpx.AsyncClient(base_url=mesh.url, timeout=120) as client:
                async def one(i: int) -> int:
                    resp = await client.post("/v1/completions", json={
                        "model": mesh.config.model_name, "prompt": [3 + i % 400] * 400,
                        "max_tokens": 4, "ignore_eos": True})
                    return resp.status_code

                tasks = []
                for i in range(60):  # ~4 prompts a second of 0.4 s each: 1.6 prefill workers
                    tasks.append(asyncio.create_task(one(i)))
                    await asyncio.sleep(0.25)
                return await asyncio.gather(*tasks)

        codes = asyncio.run(load())
        assert codes == [200] * len(codes)
        live = _metric(mesh.url + "/metrics", "evenflow_live_workers")
        assert live['role="prefill"'] == 2 and live['role="decode"'] == 1, live
        planner = _metric(mesh.metrics_urls()["plan0"], "evenflow_planner_decisions_total")
        assert planner.get('action="switch"', 0) >= 1, planner
