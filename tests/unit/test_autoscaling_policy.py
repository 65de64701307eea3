from types import SimpleNamespace

from evenflow.rayserve.autoscaling import DOWNSCALE_PERIODS, DecodePolicy, PrefillPolicy


def ctx(current, metrics, state=None, lo=1, hi=4, target=None):
    return SimpleNamespace(deployment_name="x", current_num_replicas=current,
                           target_num_replicas=current if target is None else target,
                           aggregated_metrics=metrics, policy_state=state or {},
                           capacity_adjusted_min_replicas=lo, capacity_adjusted_max_replicas=hi)


def test_prefill_scales_up_at_once_and_down_after_a_quiet_spell():
    policy = PrefillPolicy(target_queued_tokens=100)
    n, state = policy(ctx(1, {"queued_prompt_tokens": {"a": 250.0}}))
    assert n == 3
    decisions = []
    for _ in range(DOWNSCALE_PERIODS + 3):
        n, state = policy(ctx(3, {"queued_prompt_tokens": {"a": 0.0, "b": 0.0}}, state))
        decisions.append(n)
    assert decisions[: DOWNSCALE_PERIODS - 1] == [3] * (DOWNSCALE_PERIODS - 1)
    assert decisions[DOWNSCALE_PERIODS - 1 :] == [1] * 4  # and it stays decided


def test_decode_scales_on_running_sequences_and_low_kv():
    policy = DecodePolicy(target_running=10)
    assert policy(ctx(1, {"running_sequences": {"a": 25.0}}))[0] == 3
    low_kv = {"running_sequences": {"a": 1.0}, "free_kv_fraction": {"a": 0.05}}
    assert policy(ctx(2, low_kv))[0] == 3
    assert policy(ctx(1, {"running_sequences": {"a": 99.0}}, hi=2))[0] == 2  # capped


def test_a_replica_still_starting_is_not_scaled_away():
    # Running 1, target 2 (the second still loading its model): a quiet signal from the one
    # running replica holds the target instead of stopping the one that is starting.
    policy = PrefillPolicy(target_queued_tokens=100)
    state = None
    for _ in range(DOWNSCALE_PERIODS + 3):
        n, state = policy(ctx(1, {"queued_prompt_tokens": {"a": 0.0}}, state, target=2))
        assert n == 2
    for _ in range(DOWNSCALE_PERIODS - 1):  # once both run, the usual quiet spell applies
        n, state = policy(ctx(2, {"queued_prompt_tokens": {"a": 0.0, "b": 0.0}}, state))
        assert n == 2
    assert policy(ctx(2, {"queued_prompt_tokens": {"a": 0.0, "b": 0.0}}, state))[0] == 1


def test_a_planners_size_overrides_the_load_signal():
    # the replicas report the SLA planner's size for their role (FleetTarget, mode scale)
    prefill, decode = PrefillPolicy(target_queued_tokens=100), DecodePolicy(target_running=10)
    metrics = {"queued_prompt_tokens": {"a": 0.0}, "planner_target": {"a": 3.0, "b": 2.0}}
    assert prefill(ctx(1, metrics))[0] == 3  # the newest (largest) report, not the queue's 1
    assert decode(ctx(1, {"running_sequences": {"a": 99.0}, "planner_target": {"a": 2.0}}))[0] \
        == 2
    assert decode(ctx(1, {"running_sequences": {"a": 99.0}, "planner_target": {"a": 9.0}}))[0] \
        == 4  # still within the deployment's max replicas
