"""The planner's arithmetic: what each role needs for the targets, the split that leaves no
role the straggler, and when a move is made (held, urgent, not undone at once); for a fleet
that grows and shrinks, the sizes (up at once, down after a settled spell, within the cap);
and which workers the launcher starts and stops for a size."""

from __future__ import annotations

import pytest

from evenflow.planner.policy import (
    FleetLoad,
    Planner,
    Sizer,
    best_split,
    fleet_size,
    max_utilization,
    need,
)
from evenflow.planner.profile import OnlineProfile, RoleProfile

PROFILE = RoleProfile(prefill_s_per_token=0.001, decode_s_base=0.002, decode_s_per_seq=0.002)


def prefill_heavy(p: int = 2, d: int = 2) -> FleetLoad:
    # 6 requests/s of 400 tokens: 2.4 worker-seconds a second before queueing headroom
    return FleetLoad(p, d, prompt_tokens_per_s=2400, prefill_requests_per_s=6,
                     decode_tokens_per_s=48, decode_streams=2)


def decode_heavy(p: int = 2, d: int = 2) -> FleetLoad:
    return FleetLoad(p, d, prompt_tokens_per_s=100, prefill_requests_per_s=3,
                     decode_tokens_per_s=1200, decode_streams=40)


def test_utilization_bound_follows_the_ttft_budget():
    assert max_utilization(0.1, 2.0) == pytest.approx(0.9)  # far inside: capped
    assert max_utilization(1.0, 2.0) < max_utilization(0.5, 2.0)
    assert max_utilization(3.0, 2.0) == 0.5  # a prompt alone misses the target


def test_need_puts_the_load_on_the_right_role():
    heavy = need(prefill_heavy(), PROFILE, ttft_s=2.0, itl_s=0.05)
    assert heavy.prefill > 2.4 and heavy.decode < 0.5
    light = need(decode_heavy(), PROFILE, ttft_s=2.0, itl_s=0.05)
    # a worker carries (0.04 - 0.002) / 0.002 = 19 streams at 40 ms: ~475 tokens/s
    assert light.decode == pytest.approx(1200 / (19 / 0.04), rel=0.01)
    assert light.prefill < 0.2


def test_a_saturated_decode_pool_is_seen_by_its_streams():
    # tokens/s capped by what two workers can generate, but 120 streams are waiting
    load = FleetLoad(2, 2, decode_tokens_per_s=900, decode_streams=120)
    assert need(load, PROFILE, 2.0, 0.05).decode == pytest.approx(120 / 19)


def test_best_split_relieves_the_straggler_and_keeps_a_worker_per_role():
    heavy = need(prefill_heavy(), PROFILE, 2.0, 0.05)
    assert best_split(4, heavy, current_prefill=2) == 3
    light = need(decode_heavy(), PROFILE, 2.0, 0.05)
    assert best_split(4, light, current_prefill=2) == 1


def test_a_gain_must_hold_before_a_move_unless_a_target_is_missed():
    planner = Planner(ttft_s=2.0, itl_s=0.05)
    mild = FleetLoad(2, 2, prompt_tokens_per_s=1600, prefill_requests_per_s=4,
                     decode_tokens_per_s=10, decode_streams=1)
    first = planner.decide(mild, PROFILE)
    assert first.action == "hold" and first.target_prefill == 3
    assert planner.decide(mild, PROFILE).action == "to_prefill"  # held two intervals
    urgent = Planner(ttft_s=2.0, itl_s=0.05)
    assert urgent.decide(prefill_heavy(), PROFILE).action == "to_prefill"  # at once


def test_a_move_is_not_undone_at_once_by_the_backlog_it_released():
    planner = Planner(ttft_s=2.0, itl_s=0.05)
    assert planner.decide(prefill_heavy(), PROFILE).action == "to_prefill"
    planner.moved("to_prefill")
    # the next interval, the released backlog makes decode look short (urgent): held once
    burst = FleetLoad(3, 1, prompt_tokens_per_s=100, prefill_requests_per_s=1,
                      decode_tokens_per_s=900, decode_streams=60)
    assert planner.decide(burst, PROFILE).action == "hold"
    assert planner.decide(burst, PROFILE).action == "to_decode"  # it held: now it goes


def test_an_idle_a_roomy_or_a_tiny_fleet_holds():
    planner = Planner(ttft_s=2.0, itl_s=0.05)
    assert planner.decide(FleetLoad(2, 2), PROFILE).action == "hold"
    roomy = FleetLoad(2, 2, prompt_tokens_per_s=400, prefill_requests_per_s=1)
    for _ in range(3):  # a split that would halve the pressure, but there is room
        assert planner.decide(roomy, PROFILE).action == "hold"
    assert planner.decide(FleetLoad(0, 1, decode_streams=50), PROFILE).action == "hold"


def test_online_profile_learns_the_decode_line_and_the_prefill_rate():
    online = OnlineProfile(PROFILE)
    for streams in (4, 8, 16, 32, 4, 8):
        online.add_decode(streams, 0.003 + 0.0005 * streams)
    online.add_prefill(2.0, 1000)
    learned = online.current()
    assert learned.decode_s_base == pytest.approx(0.003, rel=1e-6)
    assert learned.decode_s_per_seq == pytest.approx(0.0005, rel=1e-6)
    assert learned.prefill_s_per_token == pytest.approx(0.002)
    assert OnlineProfile(PROFILE).current() == PROFILE  # no evidence: the prior


def test_profile_round_trips_through_its_file(tmp_path):
    path = str(tmp_path / "roles.json")
    RoleProfile(0.002, 0.01, 0.001, 12.0).save(path, machine="test")
    assert RoleProfile.load(path) == RoleProfile(0.002, 0.01, 0.001, 12.0)


def test_fleet_size_rounds_each_role_up_within_the_cap():
    needed = need(prefill_heavy(), PROFILE, ttft_s=1.0, itl_s=0.05)
    p, d = fleet_size(needed, max_workers=16, current_prefill=1)
    assert p >= 3 and d == 1  # 2.4 worker-seconds of prompts a second, little decode
    assert sum(fleet_size(needed, max_workers=3, current_prefill=1)) == 3
    idle = need(FleetLoad(1, 1), PROFILE, ttft_s=1.0, itl_s=0.05)
    assert fleet_size(idle, 16, 1) == (1, 1)  # a role never goes to zero


def test_sizer_grows_at_once_and_shrinks_only_after_settling():
    sizer = Sizer(ttft_s=1.0, itl_s=0.05, max_workers=8, settle_intervals=3, smoothing=1.0)
    grown = sizer.decide(prefill_heavy(1, 1), PROFILE)
    assert grown.action == "grow" and grown.target_prefill >= 3
    quiet = FleetLoad(grown.target_prefill, 1)
    held = [sizer.decide(quiet, PROFILE) for _ in range(2)]
    assert [d.action for d in held] == ["hold", "hold"]
    assert held[-1].target_prefill == grown.target_prefill
    shrunk = sizer.decide(quiet, PROFILE)
    assert shrunk.action == "shrink" and (shrunk.target_prefill, shrunk.target_decode) == (1, 1)
    # a burst within the settling spell resets it
    sizer.decide(prefill_heavy(1, 1), PROFILE)
    sizer.decide(quiet, PROFILE)
    assert sizer.decide(prefill_heavy(1, 1), PROFILE).action == "hold"


def test_sizer_at_the_cap_trades_workers_between_roles_at_once():
    sizer = Sizer(ttft_s=1.0, itl_s=0.05, max_workers=4, settle_intervals=5, smoothing=1.0)
    first = sizer.decide(decode_heavy(1, 3), PROFILE)
    assert (first.target_prefill, first.target_decode) == (1, 3)
    flipped = sizer.decide(prefill_heavy(1, 3), PROFILE)
    assert flipped.target_prefill + flipped.target_decode <= 4
    assert flipped.target_prefill >= 2 and flipped.action == "resize"


def test_resize_plan_stops_the_named_then_newest_and_reuses_free_ids():
    from evenflow.proto.messages import FleetTarget
    from evenflow.services.fleet_agent import resize_plan

    serving = {"prefill": ["p0", "p1", "p2"], "decode": ["d0"]}
    plan = resize_plan(serving, FleetTarget(planner_id="x", prefill=1, decode=3,
                                            retire=["p1"]), {"p0", "p1", "p2", "d0", "d1"})
    assert plan.stop == ["p1", "p2"]
    assert plan.start == [("decode", "d2"), ("decode", "d3")]  # d1 is still draining
    assert resize_plan(serving, FleetTarget(planner_id="x", prefill=3, decode=1),
                       set()).start == plan.stop[:0]
