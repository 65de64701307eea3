"""The straggler, measured: each expert-parallel rank's steps as its load reports give them
(step time, its own experts' compute, time in the dispatch/combine collectives, which includes
waiting for the slowest rank, and rows computed, per step), and each DEP group's balancedness
in time and in rows (mean over ranks / slowest rank), as Prometheus series."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Gauge

from evenflow.proto.messages import ExpertLoad

STEP_SECONDS = Gauge("evenflow_ep_rank_step_seconds",
                     "Mean step time of an expert-parallel rank over its last report",
                     ["group", "worker"])
MOE_COMPUTE_SECONDS = Gauge("evenflow_ep_rank_moe_compute_seconds",
                            "Mean per-step time in the rank's own experts", ["group", "worker"])
MOE_WAIT_SECONDS = Gauge("evenflow_ep_rank_moe_wait_seconds",
                         "Mean per-step time in dispatch/combine collectives (incl. waiting for "
                         "the slowest rank)", ["group", "worker"])
ROWS_PER_STEP = Gauge("evenflow_ep_rank_rows_per_step",
                      "Mean (token, expert) rows the rank computed per step", ["group", "worker"])
GROUP_BALANCEDNESS = Gauge("evenflow_ep_group_balancedness",
                           "Mean over a DEP group's ranks / its slowest rank, of MoE compute "
                           "time (by=time) or rows (by=rows), per step",
                           ["group", "by"])


@dataclass(frozen=True)
class RankSample:
    step_s: float
    compute_s: float
    wait_s: float
    rows: float


class RankStats:
    """The latest per-step sample of every rank, by DEP group."""

    def __init__(self) -> None:
        self.groups: dict[str, dict[str, RankSample]] = {}

    def observe(self, m: ExpertLoad) -> None:
        if not m.group or m.steps <= 0:
            return
        sample = RankSample(m.step_s / m.steps, m.moe_compute_s / m.steps,
                            m.moe_wait_s / m.steps, m.moe_rows / m.steps)
        STEP_SECONDS.labels(group=m.group, worker=m.worker_id).set(sample.step_s)
        MOE_COMPUTE_SECONDS.labels(group=m.group, worker=m.worker_id).set(sample.compute_s)
        MOE_WAIT_SECONDS.labels(group=m.group, worker=m.worker_id).set(sample.wait_s)
        ROWS_PER_STEP.labels(group=m.group, worker=m.worker_id).set(sample.rows)
        ranks = self.groups.setdefault(m.group, {})
        ranks[m.worker_id] = sample
        if len(ranks) > 1:
            GROUP_BALANCEDNESS.labels(group=m.group, by="time").set(
                self.balancedness(m.group, "compute_s"))
            GROUP_BALANCEDNESS.labels(group=m.group, by="rows").set(
                self.balancedness(m.group, "rows"))

    def balancedness(self, group: str, field: str) -> float:
        values = [getattr(s, field) for s in self.groups.get(group, {}).values()]
        if not values or max(values) <= 0:
            return 1.0
        return sum(values) / len(values) / max(values)
