"""Priority and tenants through a real mesh (mock engine, slow steps, one slot): who waits,
who goes next and who gets which 429, as a client sees it over HTTP."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from tests.integration.meshutil import running_mesh

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mesh():
    from evenflow.services.config import MeshConfig

    config = MeshConfig(port=0, engine="mock", mock_timing_scale=4.0, num_prefill=0,
                        local_prefill_threshold=1 << 20, num_decode=1, num_ep_ranks=0,
                        max_num_seqs=1, max_inflight=1, max_queued=2,
                        tenant_header="x-tenant", heartbeat_interval_s=0.2, num_gateways=1,
                        stats_log_interval_s=0, log_level="warning")
    with running_mesh(config) as mesh:
        yield mesh


def _queued(mesh) -> float:
    text = httpx.get(mesh.url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^evenflow_queued_requests\{[^}]*\} (\S+)$",
                                             text, re.M))


async def _run(mesh, plan: list[tuple[str, str, int]]) -> tuple[list[str], dict[str, dict]]:
    """Send each (name, tenant, priority) in turn, once the one before is running or queued;
    the order the successful ones finished in, and each refusal's error body by name."""
    finished: list[str] = []
    refused: dict[str, dict] = {}
    async with httpx.AsyncClient(base_url=mesh.url, timeout=60) as client:
        async def one(name: str, tenant: str, priority: int) -> None:
            resp = await client.post("/v1/completions", headers={"x-tenant": tenant}, json={
                "model": mesh.config.model_name, "prompt": [5, 6, 7, 8], "max_tokens": 64,
                "ignore_eos": True, "priority": priority})
            if resp.status_code == 200:
                finished.append(name)
            else:
                assert resp.status_code == 429, resp.text
                refused[name] = resp.json()["error"]

        tasks = []
        for index, (name, tenant, priority) in enumerate(plan):
            queued, refusals = await asyncio.to_thread(_queued, mesh), len(refused)
            tasks.append(asyncio.create_task(one(name, tenant, priority)))
            if index == 0:
                await asyncio.sleep(0.3)  # (it holds the one slot)
                continue
            for _ in range(250):  # until it is queued, refused, or it pushed one out
                await asyncio.sleep(0.02)
                if tasks[-1].done() or len(refused) > refusals \
                        or await asyncio.to_thread(_queued, mesh) != queued:
                    break
        await asyncio.gather(*tasks)
    return finished, refused


def test_priority_orders_the_queue_and_a_full_queue_says_which_limit(mesh):
    finished, refused = asyncio.run(_run(mesh, [
        ("first", "A", 0), ("low", "A", 5), ("high", "A", -5), ("third", "A", 0)]))
    assert finished == ["first", "high", "low"]  # the queue held low and high: high went first
    assert refused["third"]["code"] == "overloaded"
    assert "queued at this gateway" in refused["third"]["message"]


def test_a_tenant_under_its_share_pushes_a_flooding_one_out_and_goes_next(mesh):
    finished, refused = asyncio.run(_run(mesh, [
        ("a1", "A", 0), ("a2", "A", 0), ("a3", "A", 1), ("b1", "B", 0)]))
    # the queue (2) was A's alone; B's arrival pushed out A's lowest-priority, newest waiter
    assert refused.keys() == {"a3"} and refused["a3"]["code"] == "tenant_over_share"
    assert "'A'" in refused["a3"]["message"]
    # and B, furthest under its share once the slot came free, ran before A's second
    assert finished == ["a1", "b1", "a2"]
