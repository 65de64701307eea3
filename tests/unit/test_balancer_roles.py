"""The balancer keeps a placement per role (prefill and decode load differ) and turns expert-
parallel ranks' step timings into per-rank and per-group series."""

from __future__ import annotations

import msgpack
from prometheus_client import REGISTRY

from evenflow.balancer.policy import TriggerConfig
from evenflow.balancer.rank_stats import RankStats
from evenflow.balancer.role_balance import RoleBalance
from evenflow.proto.messages import ExpertLoad, decode, encode

LAYERS, EXPERTS, SLOTS, RANKS = 2, 8, 12, 4


def load(worker: str, role: str, hot: int, version: int = 0, **timing) -> ExpertLoad:
    counts = [1] * SLOTS
    counts[hot] = 200  # one hot expert
    return ExpertLoad(worker_id=worker, version=version, num_layers=LAYERS, num_slots=SLOTS,
                      counts=counts * LAYERS, role=role, **timing)


def test_each_role_is_balanced_on_its_own_load():
    trigger = TriggerConfig(threshold=0.9, min_interval=2, window=4)
    roles = {r: RoleBalance(r, EXPERTS, RANKS, trigger) for r in ("prefill", "decode")}
    pushed = []
    for _ in range(4):  # prefill load is skewed to expert 5; decode load is even
        pushed.append(roles["prefill"].observe(load("p0", "prefill", hot=5)))
        roles["decode"].observe(ExpertLoad(worker_id="d0", version=0, num_layers=LAYERS,
                                           num_slots=SLOTS, counts=[10] * SLOTS * LAYERS,
                                           role="decode"))
    placement = next(p for p in pushed if p is not None)
    assert placement.role == "prefill" and placement.version == 1
    assert placement.phy2log.count(5) > 1  # the hot expert got a replica
    assert roles["decode"].version == 0  # decode's own placement did not move


def test_rank_timings_become_per_rank_and_group_series():
    stats = RankStats()
    for worker, compute in (("d0r0", 0.004), ("d0r1", 0.001)):
        stats.observe(load(worker, "decode", hot=0, group="g1", steps=10, step_s=0.1,
                           moe_compute_s=compute * 10, moe_wait_s=0.02, moe_rows=320))
    value = REGISTRY.get_sample_value
    assert value("evenflow_ep_rank_moe_compute_seconds", {"group": "g1", "worker": "d0r0"}) \
        == 0.004
    assert abs(value("evenflow_ep_group_balancedness", {"group": "g1", "by": "time"})
               - 0.0025 / 0.004) < 1e-9
    assert value("evenflow_ep_group_balancedness", {"group": "g1", "by": "rows"}) == 1.0


def test_a_v1_load_report_still_decodes_and_v2_round_trips():
    v1 = msgpack.packb({"t": "expert_load", "v": 1, "d": ["d0", 3, 1, 2, [5, 6]]})
    old = decode(v1)
    assert isinstance(old, ExpertLoad) and old.role == "" and old.steps == 0
    v2 = load("d0", "decode", hot=0, steps=3, moe_wait_s=0.5)
    assert decode(encode(v2)) == v2


def test_malformed_load_reports_are_dropped_and_counted():
    """Negative, non-finite or wrongly shaped counts never reach the placement (a report with a
    huge negative count on one slot would otherwise look like imbalance and move experts)."""
    trigger = TriggerConfig(threshold=0.9, min_interval=1, window=2)
    role = RoleBalance("decode", EXPERTS, RANKS, trigger)

    def dropped(reason):
        return REGISTRY.get_sample_value("evenflow_eplb_reports_dropped_total",
                                         {"reason": reason}) or 0.0

    before = {r: dropped(r) for r in ("negative", "non_finite", "shape")}
    negative = [10] * SLOTS * LAYERS
    negative[3] = -10**9
    bad = [ExpertLoad(worker_id="d0", version=0, num_layers=LAYERS, num_slots=SLOTS,
                      counts=negative, role="decode"),
           ExpertLoad(worker_id="d0", version=0, num_layers=LAYERS, num_slots=SLOTS,
                      counts=[float("nan")] + [10] * (SLOTS * LAYERS - 1), role="decode"),
           ExpertLoad(worker_id="d0", version=0, num_layers=LAYERS, num_slots=SLOTS,
                      counts=[10] * (SLOTS * LAYERS - 1), role="decode"),
           load("d0", "decode", hot=1, step_s=-1.0)]
    for _ in range(3):
        assert all(role.observe(report) is None for report in bad)
    assert role.version == 0 and role.phy2log is None  # nothing taken from them
    assert dropped("negative") - before["negative"] == 6
    assert dropped("non_finite") - before["non_finite"] == 3
    assert dropped("shape") - before["shape"] == 3
