"""One role's expert placement at the balancer: the placement in force and its version, the
recent versions' layouts (load reported under them is still usable), the load window and its
trigger, and which version each worker runs. Prefill and decode see different expert load
(long prompts against single tokens), so each role gets a placement of its own.

A rebalance is three steps: `take` a report (on the event loop: the window, the trigger; the
inputs of a new placement when one is due), `plan_placement` (pure, tensors in and out: the
balancer service runs it in a thread, so that a large model's placement does not stall NATS),
`commit` the plan (on the event loop: the version in force). `observe` does all three at once."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import NamedTuple

import torch
from prometheus_client import Counter, Gauge

from evenflow.balancer.eplb import balancedness, rebalance_from, replica_shares, slots_moved
from evenflow.balancer.policy import ThresholdTrigger, TriggerConfig
from evenflow.balancer.topology import HostLoads, host_routing, topology_aware
from evenflow.proto.messages import ExpertLoad, ExpertPlacement

log = logging.getLogger(__name__)

REPORTS_DROPPED = Counter("evenflow_eplb_reports_dropped_total",
                          "Expert-load reports dropped as malformed", ["reason"])
MAX_LAYERS_X_SLOTS = 1 << 20  # no model has a million (layer, slot) pairs


def load_report_problem(m: ExpertLoad) -> str | None:
    """Why a load report cannot be used (dropped and counted, as the bus does with malformed
    messages): "shape" (counts do not fill num_layers x num_slots), "negative" or "non_finite"
    (a count or a timing), else None."""
    if not (0 < m.num_layers and 0 < m.num_slots
            and m.num_layers * m.num_slots <= MAX_LAYERS_X_SLOTS
            and len(m.counts) == m.num_layers * m.num_slots):
        return "shape"
    timings = (m.step_s, m.moe_compute_s, m.moe_wait_s, m.steps, m.moe_rows)
    values = (*m.counts, *timings)
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return "shape"
    if not all(math.isfinite(v) for v in values):
        return "non_finite"
    if any(v < 0 for v in values):
        return "negative"
    return None


_told: set[tuple[str, str]] = set()  # (worker, problem) already logged


def malformed(m: ExpertLoad) -> bool:
    """True for a report to drop: counted, and logged once per worker and problem."""
    problem = load_report_problem(m)
    if problem is None:
        return False
    REPORTS_DROPPED.labels(reason=problem).inc()
    if (m.worker_id, problem) not in _told:
        _told.add((m.worker_id, problem))
        log.warning("dropping load reports from %s: %s (counted in %s)", m.worker_id, problem,
                    "evenflow_eplb_reports_dropped_total")
    return True

VERSION = Gauge("evenflow_eplb_placement_version", "Placement version in force", ["role"])
BALANCEDNESS = Gauge("evenflow_eplb_balancedness", "Rank balancedness on the load window",
                     ["role", "when"])
SLOTS_MOVED = Counter("evenflow_eplb_slots_moved_total", "Expert slots moved by rebalances",
                      ["role"])
COMPUTE_SECONDS = Gauge("evenflow_eplb_compute_seconds", "Time to compute the last placement",
                        ["role"])
CROSS_HOST_ROWS = Gauge("evenflow_eplb_cross_host_rows_per_step",
                        "(token, expert) rows a DEP step sends to another host (each also "
                        "comes back), under the placement", ["role", "when"])
ACKED = Gauge("evenflow_eplb_workers_on_version", "Workers reporting load under the version",
              ["role"])

MIN_GAIN = 0.01  # a new placement must raise balancedness by this much
HISTORY = 4  # versions back whose load reports are still used


class PlanInputs(NamedTuple):
    """What a new placement is computed from: copies, since the window keeps moving on the
    event loop while a thread computes."""
    version: int  # the placement in force, which the plan replaces
    phy2log: torch.Tensor  # [layers, slots] in force
    shares: torch.Tensor | None  # [layers, slots] routing fractions in force (None: even)
    load: torch.Tensor  # [layers, experts] the window's token counts
    num_ranks: int
    topology: tuple[torch.Tensor, torch.Tensor, float] | None  # HostLoads.view()


class Plan(NamedTuple):
    version: int  # PlanInputs.version
    phy2log: torch.Tensor  # [layers, slots]
    shares: torch.Tensor  # [layers, slots]
    before: float  # balancedness on the window, in force (less MIN_GAIN when hosts gain)
    after: float  # balancedness on the window, planned
    seconds: float  # to compute
    cross_host_rows: tuple[float, float, int] | None  # per step before, after; hosts


def plan_placement(inputs: PlanInputs) -> Plan:
    """A migration-aware placement for the window's load; with ranks on several hosts, one that
    sends fewer rows across them. Pure: callable from any thread."""
    version, current, current_shares, load, num_ranks, topology = inputs
    before = balancedness(load, current, num_ranks, current_shares)
    started = time.perf_counter()
    phy2log = rebalance_from(current, load, num_ranks).phy2log
    shares = replica_shares(load, phy2log, num_ranks)
    after = balancedness(load, phy2log, num_ranks, shares)
    cross_host_rows = None
    if topology is not None:  # a group across hosts: fewer rows crossing them
        by_host, rank_host, steps = topology
        loads, cross = host_routing(by_host, current, num_ranks, rank_host)
        before = float((loads.mean(1) / loads.max(1).values.clamp_min(1e-12)).mean())
        phy2log = topology_aware(phy2log, by_host, num_ranks, rank_host)
        shares = torch.ones(phy2log.shape)  # even among the replicas a host routes to
        loads, cross_after = host_routing(by_host, phy2log, num_ranks, rank_host)
        after = float((loads.mean(1) / loads.max(1).values.clamp_min(1e-12)).mean())
        per_step = 1 / max(steps, 1e-9)
        cross_host_rows = (float(cross.sum()) * per_step, float(cross_after.sum()) * per_step,
                           int(by_host.shape[0]))
        if float(cross_after.sum()) < 0.9 * float(cross.sum()):
            before -= MIN_GAIN  # fewer crossing rows is worth a move by itself
    return Plan(version, phy2log, shares, before, after, time.perf_counter() - started,
                cross_host_rows)


class RoleBalance:
    def __init__(self, role: str, num_experts: int, num_ranks: int,
                 trigger: TriggerConfig) -> None:
        self.role = role  # "" when one placement serves every role
        self.num_experts, self.num_ranks = num_experts, num_ranks
        self.trigger = ThresholdTrigger(trigger, num_ranks)
        self.version = 0
        self.phy2log: torch.Tensor | None = None  # (layers, slots) of the version in force
        self.shares: torch.Tensor | None = None
        self.history: dict[int, torch.Tensor] = {}  # recent versions' phy2log
        self.worker_versions: dict[str, int] = {}
        self.stored_version = 0  # the newest version known to be in Redis
        self.store_lock = asyncio.Lock()
        self.hosts = HostLoads()  # where the load comes from, for DEP groups across hosts

    @property
    def label(self) -> str:
        return self.role or "all"

    def adopt(self, p: ExpertPlacement) -> None:
        self.version = p.version
        self.phy2log = torch.tensor(p.phy2log).view(p.num_layers, p.num_slots)
        self.shares = torch.tensor(p.shares).view(p.num_layers, p.num_slots)
        self.history[p.version] = self.phy2log
        VERSION.labels(role=self.label).set(p.version)

    def message(self) -> ExpertPlacement:
        assert self.phy2log is not None and self.shares is not None
        L, P = self.phy2log.shape
        return ExpertPlacement(version=self.version, num_layers=L, num_slots=P,
                               phy2log=self.phy2log.flatten().tolist(),
                               shares=self.shares.flatten().tolist(), role=self.role)

    def observe(self, message: ExpertLoad) -> ExpertPlacement | None:
        """Take one worker's load report; a new placement when the window calls for one, planned
        and committed here (the balancer service plans off its event loop instead)."""
        inputs = self.take(message)
        return None if inputs is None else self.commit(plan_placement(inputs))

    def take(self, message: ExpertLoad) -> PlanInputs | None:
        """Take one worker's load report; the inputs of a new placement when the window calls
        for one. A malformed report (load_report_problem) is dropped and counted."""
        if malformed(message):
            return None
        L, P = message.num_layers, message.num_slots
        if self.phy2log is None:  # the workers' initial placement: slot s holds s mod E
            self.phy2log = (torch.arange(P) % self.num_experts).repeat(L, 1)
            self.shares = torch.ones(L, P)
            self.history[0] = self.phy2log
        self.worker_versions[message.worker_id] = message.version
        ACKED.labels(role=self.label).set(
            sum(1 for v in self.worker_versions.values() if v == self.version))
        layout = self.history.get(message.version)
        if layout is None or layout.shape != (L, P):
            return None  # load under a placement we no longer know: skip it
        slot_counts = torch.tensor(message.counts, dtype=torch.float32).view(L, P)
        logical = torch.zeros(L, self.num_experts).scatter_add_(1, layout, slot_counts)
        self.hosts.add(message.ep_rank, message.ep_size, message.host, logical, message.steps)
        if self.hosts.group_size and P % self.hosts.group_size == 0:
            # an elastic group runs with this many ranks now (placements fold onto them)
            self.num_ranks = self.trigger.num_gpus = self.hosts.group_size
        if not self.trigger.observe(logical, self.phy2log, self._slot_shares()):
            return None
        shares = self._slot_shares()
        return PlanInputs(self.version, self.phy2log.clone(),
                          None if shares is None else shares.clone(),
                          self.trigger.window.load().clone(), self.num_ranks, self.hosts.view())

    def _slot_shares(self) -> torch.Tensor | None:
        """The shares in force as routing fractions per slot (None: even split)."""
        return None if self.version == 0 else self.shares

    def commit(self, plan: Plan) -> ExpertPlacement | None:
        """Put a plan in force when it gains enough: the placement to publish."""
        COMPUTE_SECONDS.labels(role=self.label).set(plan.seconds)
        if plan.cross_host_rows is not None:
            cross, cross_after, hosts = plan.cross_host_rows
            CROSS_HOST_ROWS.labels(role=self.label, when="before").set(cross)
            CROSS_HOST_ROWS.labels(role=self.label, when="after").set(cross_after)
            log.info("%s placement across %d hosts: rows crossing hosts per step %.1f -> %.1f",
                     self.label, hosts, cross, cross_after)
        if plan.version != self.version:
            return None  # planned from a placement no longer in force
        assert self.phy2log is not None
        phy2log, shares, before, after = plan.phy2log, plan.shares, plan.before, plan.after
        if after < before + MIN_GAIN:
            return None  # not worth moving weights (nor waking every worker) for
        moved = slots_moved(self.phy2log, phy2log)
        self.version += 1
        self.phy2log, self.shares = phy2log, shares
        self.history[self.version] = self.phy2log
        for old in [v for v in self.history if v < self.version - HISTORY]:
            del self.history[old]
        BALANCEDNESS.labels(role=self.label, when="before").set(before)
        BALANCEDNESS.labels(role=self.label, when="after").set(after)
        SLOTS_MOVED.labels(role=self.label).inc(moved)
        VERSION.labels(role=self.label).set(self.version)
        log.info("%s placement %d: balancedness %.3f -> %.3f, %d slots moved", self.label,
                 self.version, before, after, moved)
        return self.message()
