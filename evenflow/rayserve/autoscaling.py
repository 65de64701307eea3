"""Custom Ray Serve autoscaling policies, one per service signal. Pure functions of Serve's
AutoscalingContext: desired replicas from the replicas' reported metrics, scaled up at once,
down only after the signal has stayed low for a few periods (no flapping). Where an SLA
planner runs in mode scale (evenflow/planner/), the replicas report its sizes for their role
(`planner_target`), and the policy follows those instead of its own signal."""

from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger("ray.serve")

DOWNSCALE_PERIODS = 5  # consecutive decisions below the current count before shrinking
# Default targets per replica (README's table and deploy/serve.yaml say the same).
TARGET_ONGOING_REQUESTS = 32.0  # gateway (Serve's own policy)
TARGET_QUEUED_TOKENS = 2048.0  # prefill
TARGET_RUNNING = 32.0  # decode


def _metric_total(ctx: Any, name: str) -> float:
    per_replica = (ctx.aggregated_metrics or {}).get(name, {})
    return float(sum(per_replica.values()))


def _planner_target(ctx: Any) -> int | None:
    """The planner's size for this deployment, as its replicas report it (the largest: a
    replica that heard a newer, larger target should not wait for the others)."""
    reported = (ctx.aggregated_metrics or {}).get("planner_target", {})
    return max(1, math.ceil(max(reported.values()))) if reported else None


def _decide(ctx: Any, desired: int) -> tuple[int, dict[str, Any]]:
    """Serve's delays apply on top, measured against its target (`target_num_replicas`, which
    counts replicas still starting), so holding means answering the target, not the running
    count. While a scale-up is under way (target > running) nothing shrinks: the running
    replicas' signal alone is not the fleet's, and stopping a replica that is still loading
    its model is churn (each start costs a process and a model load)."""
    running = ctx.current_num_replicas
    target = max(running, getattr(ctx, "target_num_replicas", running) or running)
    log.debug("evenflow policy %s: desired %d, running %d, target %d", ctx.deployment_name,
              desired, running, target)
    state = dict(ctx.policy_state or {})
    desired = max(ctx.capacity_adjusted_min_replicas,
                  min(ctx.capacity_adjusted_max_replicas, desired))
    if desired >= target or target > running:
        state["low_periods"] = 0
        return max(desired, target), state
    state["low_periods"] = state.get("low_periods", 0) + 1
    if state["low_periods"] >= DOWNSCALE_PERIODS:  # low long enough: keep saying so
        return desired, state
    return target, state


class PrefillPolicy:
    """Prefill scales on queued prompt tokens: one replica per `target_queued_tokens`."""

    def __init__(self, target_queued_tokens: float = TARGET_QUEUED_TOKENS) -> None:
        self.target = target_queued_tokens

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        planned = _planner_target(ctx)
        if planned is not None:
            return _decide(ctx, planned)
        queued = _metric_total(ctx, "queued_prompt_tokens")
        return _decide(ctx, max(1, math.ceil(queued / self.target)))


class DecodePolicy:
    """Decode scales on running sequences, and up when free KV blocks run low."""

    def __init__(self, target_running: float = TARGET_RUNNING,
                 min_free_kv_fraction: float = 0.2) -> None:
        self.target, self.min_free = target_running, min_free_kv_fraction

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        planned = _planner_target(ctx)
        if planned is not None:
            return _decide(ctx, planned)
        running = _metric_total(ctx, "running_sequences")
        desired = max(1, math.ceil(running / self.target))
        free = (ctx.aggregated_metrics or {}).get("free_kv_fraction", {})
        if free and sum(free.values()) / len(free) < self.min_free:
            desired = max(desired, ctx.current_num_replicas + 1)
        return _decide(ctx, desired)
