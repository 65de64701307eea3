"""The planner actor: workers' heartbeats in, every `planner_interval_s` a decision
(policy.py) from the load since the last one, and the decision carried out: a RoleSwitch to
one worker (mode `switch`: in place; `restart`: the worker drains and exits, and the launcher
starts it again in the other role, as a fleet without in-place switching must), a FleetTarget
sizing each role for whoever starts and stops workers (`scale`: `evenflow up`'s launcher, or
Ray Serve's autoscaling policies), or a log line and the metrics only (`advisory`). While
workers move, the next decision waits until each heartbeats in its new role. Stopping or
replacing the planner touches nothing else: the workers keep the roles they have."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from evenflow.planner.policy import Decision, FleetLoad, Planner, Sizer
from evenflow.planner.profile import OnlineProfile, RoleProfile
from evenflow.proto import subjects
from evenflow.proto.messages import (
    WORKER_ROLES,
    FleetTarget,
    Message,
    Role,
    RoleSwitch,
    WorkerHeartbeat,
)
from evenflow.services.bus import MessageBus
from evenflow.services.config import MeshConfig
from evenflow.services.metrics import (
    PLANNER_DECISIONS,
    PLANNER_ESTIMATE,
    PLANNER_LIVE_WORKERS,
    PLANNER_TARGET_WORKERS,
)
from evenflow.services.worker import WorkerService

log = logging.getLogger(__name__)


@dataclass
class _Seen:
    latest: WorkerHeartbeat
    seen_at: float  # monotonic
    baseline: WorkerHeartbeat | None = None  # at the last decision (same epoch)


@dataclass
class _Move:
    worker_id: str
    to_role: Role
    sent_at: float  # monotonic
    epoch: str  # the worker's epoch when told (a new one: the move is done)


def fleet_load(workers: list[_Seen], seconds: float) -> FleetLoad:
    """The fleet's load since each worker's baseline (workers without one count as
    present, not as load). A worker draining towards a role counts in that role."""
    counts = {Role.PREFILL: 0, Role.DECODE: 0}
    prompt = requests = queued = local = streams = generated = 0.0
    for w in workers:
        hb, base = w.latest, w.baseline
        role = Role(hb.switching_to) if hb.switching_to else hb.role
        counts[role] += 1
        if hb.role is Role.PREFILL:
            queued += hb.queued_prompt_tokens
        else:
            streams += hb.running + hb.waiting
        if base is None or seconds <= 0:
            continue
        d_prompt = hb.prompt_tokens_computed - base.prompt_tokens_computed
        if hb.role is Role.PREFILL:
            prompt += d_prompt
            requests += hb.requests_finished - base.requests_finished
        else:
            local += d_prompt
            generated += hb.output_tokens - base.output_tokens
    s = max(seconds, 1e-9)
    return FleetLoad(counts[Role.PREFILL], counts[Role.DECODE], prompt / s, requests / s, queued,
                     local / s, streams, generated / s)


class PlannerService(WorkerService):
    role = Role.PLANNER

    def __init__(self, config: MeshConfig, worker_id: str, bus: MessageBus | None = None) -> None:
        super().__init__(config, worker_id, bus)
        prior = RoleProfile.load(config.planner_profile) if config.planner_profile \
            else RoleProfile()
        self.profile = OnlineProfile(prior)
        self.planner = Planner(config.ttft_ms / 1e3, config.itl_ms / 1e3)
        self.sizer = Sizer(config.ttft_ms / 1e3, config.itl_ms / 1e3, config.fleet_limit())
        self.workers: dict[str, _Seen] = {}
        self.moves: list[_Move] = []  # sent, not yet seen done
        self._last_decision = time.monotonic()

    async def start(self) -> None:
        await self.bus.subscribe(subjects.HEARTBEATS, self._on_heartbeat)
        self._owned_tasks.append(asyncio.create_task(self._decide_every_interval(),
                                                     name="planner"))
        log.info("planner: mode %s, TTFT target %g ms, ITL target %g ms, every %g s, profile "
                 "%s", self.config.planner_mode, self.config.ttft_ms, self.config.itl_ms,
                 self.config.planner_interval_s, self.config.planner_profile or "measured online")

    def _on_heartbeat(self, message: Message, _ctx: object) -> None:
        if not isinstance(message, WorkerHeartbeat) or message.role not in WORKER_ROLES:
            return
        seen = self.workers.get(message.worker_id)
        if seen is None or seen.latest.epoch != message.epoch:  # new, restarted or switched
            self.workers[message.worker_id] = _Seen(message, time.monotonic())
        else:
            seen.latest, seen.seen_at = message, time.monotonic()

    def live(self) -> list[_Seen]:
        cutoff = time.monotonic() - self.config.worker_timeout_s
        for worker_id in [w for w, s in self.workers.items() if s.seen_at < cutoff]:
            del self.workers[worker_id]
        return [s for s in self.workers.values()
                if not (s.latest.draining and not s.latest.switching_to)
                and not s.latest.unhealthy]

    async def _decide_every_interval(self) -> None:
        while True:
            await asyncio.sleep(self.config.planner_interval_s)
            try:
                self.decide_once()
            except Exception:  # one bad decision must not stop the planner
                log.exception("planner decision failed")

    def decide_once(self) -> Decision | None:
        now = time.monotonic()
        seconds, self._last_decision = now - self._last_decision, now
        workers = self.live()
        load = fleet_load(workers, seconds)
        self._learn(workers)
        for w in workers:  # the next interval's deltas start here
            w.baseline = w.latest
        profile = self.profile.current()
        if self.config.planner_mode == "scale":
            return self._size(load, workers)
        decision = self.planner.decide(load, profile)
        self._export(load, decision)
        if self._move_under_way(workers, now):
            PLANNER_DECISIONS.labels("wait").inc()
            return decision
        if decision.action == "hold":
            PLANNER_DECISIONS.labels("hold").inc()
            log.debug("planner: hold: %s", decision.reason)
            return decision
        self._act(decision, workers, now)
        return decision

    def _learn(self, workers: list[_Seen]) -> None:
        """The online profile's evidence from this interval (unless a file fixed it)."""
        if self.config.planner_profile:
            return
        for w in workers:
            hb, base = w.latest, w.baseline
            if base is None:
                continue
            if hb.role is Role.PREFILL:
                self.profile.add_prefill(hb.step_seconds - base.step_seconds,
                                         hb.prompt_tokens_computed - base.prompt_tokens_computed)
            elif hb.stream_tokens > base.stream_tokens:
                itl = (hb.stream_seconds - base.stream_seconds) / (
                    hb.stream_tokens - base.stream_tokens)
                self.profile.add_decode(float(hb.running), itl)

    def _move_under_way(self, workers: list[_Seen], now: float) -> bool:
        """Whether moves sent are still under way (each done once its worker heartbeats in
        its new role, or given up on after a bound)."""
        seen = {w.latest.worker_id: w.latest for w in workers}
        bound = self.config.role_switch_drain_s + 3 * self.config.planner_interval_s + 30
        for move in list(self.moves):
            hb = seen.get(move.worker_id)
            if hb is not None and hb.role is move.to_role and hb.epoch != move.epoch:
                log.info("planner: %s serves %s now", move.worker_id, move.to_role)
                self.moves.remove(move)
            elif now - move.sent_at > bound:
                log.warning("planner: %s did not come back as %s within %.0f s; planning on",
                            move.worker_id, move.to_role, bound)
                self.moves.remove(move)
        return bool(self.moves)

    def _act(self, decision: Decision, workers: list[_Seen], now: float) -> None:
        """Move as many workers as the decision's split asks (a role keeps one worker): the
        donors with least to drain (fewest streams, or the shortest prompt queue)."""
        to_role = Role.PREFILL if decision.action == "to_prefill" else Role.DECODE
        live_prefill = sum(1 for w in workers if w.latest.role is Role.PREFILL)
        count = abs(decision.target_prefill - live_prefill)
        donors = sorted((w.latest for w in workers if w.latest.role is not to_role
                         and not w.latest.draining),
                        key=lambda hb: (hb.running + hb.waiting, hb.queued_prompt_tokens))
        donors = donors[:max(0, min(count, len(donors) - 1))]
        if not donors:
            PLANNER_DECISIONS.labels("hold").inc()
            return
        mode = self.config.planner_mode
        if mode == "advisory":
            PLANNER_DECISIONS.labels("advise").inc()
            log.info("planner (advisory): would switch %s to %s: %s",
                     ", ".join(f"{hb.role} {hb.worker_id}" for hb in donors), to_role,
                     decision.reason)
            return
        in_place = mode == "switch"
        for donor in donors:
            PLANNER_DECISIONS.labels("switch" if in_place else "restart").inc()
            log.info("planner: %s %s %s to %s: %s", "switching" if in_place else "restarting",
                     donor.role, donor.worker_id, to_role, decision.reason)
            self.moves.append(_Move(donor.worker_id, to_role, now, donor.epoch))
            self.send(subjects.control(donor.worker_id), RoleSwitch(
                worker_id=donor.worker_id, to_role=str(to_role),
                drain_s=self.config.role_switch_drain_s, reason=decision.reason,
                in_place=in_place))
        self.planner.moved(decision.action)

    def _size(self, load: FleetLoad, workers: list[_Seen]) -> Decision:
        """Mode scale: the sizes each role needs, sent every interval (a FleetTarget), with the
        workers to stop first where a role shrinks: its least loaded."""
        decision = self.sizer.decide(load, self.profile.current())
        self._export(load, decision)
        PLANNER_DECISIONS.labels(decision.action).inc()
        retire: list[str] = []
        for role, want in ((Role.PREFILL, decision.target_prefill),
                           (Role.DECODE, decision.target_decode)):
            serving = sorted((w.latest for w in workers if w.latest.role is role),
                             key=lambda hb: (hb.running + hb.waiting, hb.queued_prompt_tokens))
            retire += [hb.worker_id for hb in serving[:max(0, len(serving) - want)]]
        if decision.action != "hold":
            log.info("planner: %s to %dP/%dD: %s", decision.action, decision.target_prefill,
                     decision.target_decode, decision.reason)
        self.send(subjects.FLEET_TARGET, FleetTarget(
            planner_id=self.worker_id, prefill=decision.target_prefill,
            decode=decision.target_decode, retire=retire, reason=decision.reason))
        return decision

    def _export(self, load: FleetLoad, decision: Decision) -> None:
        PLANNER_TARGET_WORKERS.labels("prefill").set(decision.target_prefill)
        PLANNER_TARGET_WORKERS.labels("decode").set(decision.target_decode)
        PLANNER_LIVE_WORKERS.labels("prefill").set(load.prefill_workers)
        PLANNER_LIVE_WORKERS.labels("decode").set(load.decode_workers)
        needed = decision.needed
        for name, value in (("ttft_s", needed.ttft_s), ("itl_s", needed.itl_s),
                            ("prefill_workers_needed", needed.prefill),
                            ("decode_workers_needed", needed.decode),
                            ("prompt_tps", load.prompt_tokens_per_s),
                            ("decode_streams", load.decode_streams)):
            PLANNER_ESTIMATE.labels(name).set(value if value < 1e9 else 1e9)
