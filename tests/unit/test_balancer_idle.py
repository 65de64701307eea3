"""An idle balancer does not stall its event loop: load reports with no token in them never
call for a placement (an all-zero window read as balancedness 0 did, every few reports), and a
placement that is due is computed in a thread while the loop keeps running."""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from evenflow.balancer import service
from evenflow.balancer.policy import ThresholdTrigger, TriggerConfig
from evenflow.balancer.rank_stats import RankStats
from evenflow.balancer.role_balance import Plan, PlanInputs, RoleBalance, plan_placement
from evenflow.balancer.service import BalancerService
from evenflow.proto.messages import ExpertLoad, ExpertPlacement
from evenflow.services.config import MeshConfig

LAYERS, EXPERTS, SLOTS, RANKS = 2, 8, 12, 4


def report(counts: list[int], worker: str = "d0") -> ExpertLoad:
    return ExpertLoad(worker_id=worker, version=0, num_layers=LAYERS, num_slots=SLOTS,
                      counts=counts * LAYERS, role="decode")


def skewed() -> ExpertLoad:
    counts = [1] * SLOTS
    counts[5] = 200  # one hot expert
    return report(counts)


def test_idle_load_reports_never_call_for_a_placement():
    trigger = ThresholdTrigger(TriggerConfig(threshold=0.9, min_interval=2, window=4), RANKS)
    placement = torch.arange(SLOTS).repeat(LAYERS, 1) % EXPERTS
    assert not any(trigger.observe(torch.zeros(LAYERS, EXPERTS), placement) for _ in range(20))
    role = RoleBalance("decode", EXPERTS, RANKS, TriggerConfig(threshold=0.9, min_interval=2,
                                                               window=4))
    assert all(role.take(report([0] * SLOTS)) is None for _ in range(20))
    assert role.version == 0
    # load arrives: the placement is due as before
    assert any(role.take(skewed()) is not None for _ in range(4))


def test_a_due_placement_is_computed_off_the_event_loop(monkeypatch):
    threads: list[threading.Thread] = []

    def slow_plan(inputs: PlanInputs) -> Plan:
        threads.append(threading.current_thread())
        time.sleep(0.3)  # what a large model's placement may take
        return plan_placement(inputs)

    monkeypatch.setattr(service, "plan_placement", slow_plan)

    async def scenario() -> tuple[int, list[ExpertPlacement]]:
        balancer = BalancerService(MeshConfig(), "eplb-test")
        balancer.roles = {"decode": RoleBalance(
            "decode", EXPERTS, RANKS, TriggerConfig(threshold=0.9, min_interval=2, window=4))}
        balancer.rank_stats, balancer._planning, balancer.redis = RankStats(), {}, None
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        for _ in range(6):  # due after 2; the later ones arrive while it is computed
            balancer._on_load(skewed(), None)
        assert set(balancer._planning) == {"decode"}
        await asyncio.gather(*balancer._planning.values())
        ticker.cancel()
        sent = []
        while not balancer._outbox.empty():
            sent.append(balancer._outbox.get_nowait()[1])
        return ticks, [m for m in sent if isinstance(m, ExpertPlacement)]

    ticks, placements = asyncio.run(scenario())
    assert len(threads) == 1 and threads[0] is not threading.main_thread()  # one at a time
    assert ticks >= 10  # the loop ran on while the placement was computed
    assert [p.version for p in placements] == [1] and placements[0].phy2log.count(5) > 1
