"""The gateway's routing decision: cost = w * blocks_to_prefill + load, the load cap, ties."""

from __future__ import annotations

import collections
import random

from evenflow.gateway.router import RouterWeights, WorkerRegistry, WorkerState, choose
from evenflow.proto.messages import WorkerHeartbeat


def worker(name: str, role: str = "prefill", queued_tokens: int = 0, running: int = 0,
           free_blocks: int = 1000, by_gateway: dict[str, int] | None = None) -> WorkerState:
    hb = WorkerHeartbeat(worker_id=name, role=role, model="m", running=running, waiting=0,
                         free_kv_blocks=free_blocks, total_kv_blocks=1000,
                         queued_prompt_tokens=queued_tokens, sent_at=0.0, epoch="e",
                         load_by_gateway=by_gateway or {})
    return WorkerState(hb, 0.0)


def test_the_worker_holding_the_prefix_wins_against_a_little_load():
    a, b = worker("a"), worker("b")
    picked = choose([a, b], total_blocks=10, matched={"b": 8}, load={"a": 0.0, "b": 3.0},
                    weights=RouterWeights(), rng=random.Random(0))
    assert picked is b  # 10 + 0 against 2 + 3


def test_load_outweighs_a_small_prefix():
    a, b = worker("a"), worker("b")
    picked = choose([a, b], total_blocks=10, matched={"b": 2}, load={"a": 0.0, "b": 5.0},
                    weights=RouterWeights(), rng=random.Random(0))
    assert picked is a  # 10 + 0 against 8 + 5


def test_a_hot_prefix_cannot_pile_everything_onto_one_worker():
    a, b = worker("a"), worker("b")
    weights = RouterWeights(load_cap=16)
    picked = choose([a, b], total_blocks=100, matched={"b": 100}, load={"a": 0.0, "b": 20.0},
                    weights=weights, rng=random.Random(0))
    assert picked is a  # b would be cheaper, but it is more than 16 blocks busier than a


def test_ties_spread_over_the_fleet():
    workers = [worker(n) for n in "abcd"]
    rng = random.Random(0)
    counts = collections.Counter(
        choose(workers, 6, {}, {w.worker_id: 0.0 for w in workers}, RouterWeights(), rng).worker_id
        for _ in range(400))
    assert set(counts) == set("abcd") and min(counts.values()) > 60


def test_temperature_samples_cheaper_workers_more_often():
    a, b = worker("a"), worker("b")
    rng = random.Random(0)
    weights = RouterWeights(temperature=2.0)
    counts = collections.Counter(
        choose([a, b], 10, {"b": 4}, {"a": 0.0, "b": 0.0}, weights, rng).worker_id
        for _ in range(400))
    assert counts["b"] > 3 * counts["a"] > 0


def test_policies_compared_against():
    registry = WorkerRegistry(timeout_s=60, weights=RouterWeights(policy="least_load"))
    for hb in (worker("p0", queued_tokens=64).heartbeat, worker("p1").heartbeat,
               worker("d0", "decode", running=3).heartbeat, worker("d1", "decode").heartbeat,
               worker("d2", "decode", free_blocks=2).heartbeat):
        registry.observe(hb)
    assert registry.pick_prefill(10, {"p0": 10}, block_size=16).worker_id == "p1"
    assert registry.pick_decode(10, {}, exclude=set()).worker_id == "d1"  # d2 lacks room
    assert registry.pick_decode(10, {}, exclude={"d1"}).worker_id == "d0"
    registry.weights = RouterWeights(policy="round_robin")
    picks = [registry.pick_prefill(10, {}, block_size=16).worker_id for _ in range(4)]
    assert picks == ["p0", "p1", "p0", "p1"]


def test_in_flight_requests_already_in_a_heartbeat_count_once():
    registry = WorkerRegistry(timeout_s=60, weights=RouterWeights(policy="least_load"))
    registry.observe(worker("d0", "decode", running=2).heartbeat)
    registry.observe(worker("d1", "decode", running=0).heartbeat)
    registry.workers["d0"].inflight = 2  # the two the heartbeat reports
    registry.workers["d1"].inflight = 3  # routed since its last heartbeat
    assert registry.pick_decode(4, {}, exclude=set()).worker_id == "d0"


def test_own_requests_count_from_the_gateway_others_from_the_heartbeat():
    registry = WorkerRegistry(timeout_s=60, weights=RouterWeights(policy="least_load"),
                              own_subject="me")
    # d0's heartbeat still shows two of ours that have finished since, and one of another
    # gateway's; d1 has two of ours that its heartbeat has not reported yet.
    registry.observe(worker("d0", "decode", running=3, by_gateway={"me": 2, "gw2": 1}).heartbeat)
    registry.observe(worker("d1", "decode").heartbeat)
    registry.workers["d1"].inflight = 2
    assert registry.pick_decode(4, {}, exclude=set()).worker_id == "d0"  # 1 against 2
    registry.observe(worker("p0", queued_tokens=640, by_gateway={"gw2": 640}).heartbeat)
    registry.observe(worker("p1", queued_tokens=320, by_gateway={"me": 320}).heartbeat)
    registry.workers["p1"].inflight_blocks = 30
    # p0: another gateway's 40 blocks; p1: our 30 in flight (its heartbeat's 20 included).
    assert registry.pick_prefill(4, {}, block_size=16).worker_id == "p1"


def test_a_stream_leaving_a_deterministic_worker_prefers_one_of_the_same_numerics():
    import dataclasses

    registry = WorkerRegistry(timeout_s=60, weights=RouterWeights(policy="least_load"))
    same = "deterministic float32"
    for name, numerics, running in (("d1", same, 0), ("d2", same, 5), ("d5", "", 0)):
        hb = dataclasses.replace(worker(name, "decode", running=running).heartbeat,
                                 numerics=numerics)
        registry.observe(hb)
    # d1 died mid-stream: d5 is less loaded than d2, but would continue with other numbers
    exclude = {"d1"} | registry.other_numerics("d1")
    assert exclude == {"d1", "d5"}
    assert registry.pick_decode(4, {}, exclude=exclude).worker_id == "d2"
    assert registry.other_numerics("d5") == set()  # (not batch-invariant: anywhere)
    assert registry.other_numerics("gone") == set()


def test_heartbeats_that_stop_and_come_back_mark_the_worker_cut_off(monkeypatch):
    """A worker cut off from the bus (a NATS node lost, a link down) and back: the gateway
    notes when, so requests sent to it meanwhile and silent since are sent again."""
    import dataclasses

    import evenflow.gateway.router as router

    clock = [100.0]
    monkeypatch.setattr(router.time, "monotonic", lambda: clock[0])
    registry = WorkerRegistry(timeout_s=60, gap_s=2.0)
    hb = worker("d1", "decode").heartbeat
    registry.observe(hb)
    clock[0] += 0.5
    registry.observe(hb)
    assert registry.resumed_at("d1") == 0.0  # on time: not cut off
    other = worker("d2", "decode").heartbeat
    for _ in range(10):  # d2 keeps beating while d1 is silent for 5 s
        clock[0] += 0.5
        registry.observe(other)
    registry.observe(hb)
    assert registry.resumed_at("d1") == 105.5
    assert registry.resumed_at("unknown") == 0.0
    clock[0] += 5.0  # nothing from anyone: the gateway's own gap, not d1's
    registry.observe(hb)
    assert registry.resumed_at("d1") == 105.5
    clock[0] += 0.5  # d1's own connection came back (it says so), with no gap in between
    registry.observe(dataclasses.replace(hb, reconnects=1))
    assert registry.resumed_at("d1") == 111.0
