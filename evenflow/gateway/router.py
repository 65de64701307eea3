"""Which workers to use: live workers from heartbeats, and one pure cost function.

KV-aware routing (Dynamo's form): cost = w * blocks_to_prefill + load, in block units, where
blocks_to_prefill is what the worker would still compute after its cached prefix (from the KV
index) and load this gateway's in-flight work there (exact and fresh) plus the other gateways'
share of the work its last heartbeat reports (heartbeats say how much each gateway has there;
counting our own from a heartbeat too would count it twice, and stale). Workers much busier
than the idlest (load_cap_blocks) are skipped, so one hot prefix cannot pile everything onto
one worker. `least_load` and `round_robin` are there to compare against.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass

from evenflow.proto.messages import Role, WorkerHeartbeat

LIVE_CACHE_S = 0.05  # how stale WorkerRegistry.live() may be (liveness is seconds)


@dataclass
class WorkerState:
    heartbeat: WorkerHeartbeat
    seen_at: float  # local monotonic clock
    inflight: int = 0  # this gateway's requests routed there and not finished
    inflight_blocks: int = 0  # blocks those requests still have to prefill there
    draining: bool = False  # it said so (heartbeat or a refusal); one-way for this epoch
    # when its heartbeats came back after a gap (it was cut off from the bus: a NATS node lost,
    # a link down): what was sent to it, or by it, meanwhile may be lost
    resumed_at: float = 0.0

    @property
    def takes_work(self) -> bool:
        return not (self.draining or self.heartbeat.unhealthy)

    @property
    def worker_id(self) -> str:
        return self.heartbeat.worker_id


def cost(w: float, blocks_to_prefill: float, load: float) -> float:
    """cost = w * blocks_to_prefill + load (lower is better)."""
    return w * blocks_to_prefill + load


@dataclass(frozen=True)
class RouterWeights:
    policy: str = "kv"
    overlap: float = 1.0
    decode_load: float = 4.0
    load_cap: float = 256.0
    temperature: float = 0.0


def choose(candidates: list[WorkerState], total_blocks: int, matched: Mapping[str, float],
           load: dict[str, float], weights: RouterWeights, rng: random.Random) -> WorkerState:
    """The cheapest candidate (or a softmax sample when temperature > 0). Pure but for `rng`."""
    floor = min(load[c.worker_id] for c in candidates)
    capped = [c for c in candidates if load[c.worker_id] <= floor + weights.load_cap]
    costs = [cost(weights.overlap, total_blocks - matched.get(c.worker_id, 0), load[c.worker_id])
             for c in capped]
    low = min(costs)
    if weights.temperature <= 0:
        # Ties go to a random one of the cheapest: sequential requests on an idle fleet then
        # spread over every worker's cache instead of filling the first worker's alone.
        return rng.choice([c for c, x in zip(capped, costs, strict=True) if x == low])
    probs = [math.exp(-(c - low) / weights.temperature) for c in costs]
    return rng.choices(capped, weights=probs)[0]


def current_load(hb: WorkerHeartbeat, own: str, own_load: float, reported: int,
                 per_unit: float = 1.0, peers: Mapping[str, float] | None = None) -> float:
    """This gateway's own load on a worker (fresh) plus the other gateways': what they last
    synced (`peers`, gateway -> load in the result's units: fresh, gateway/peers.py), else
    what the worker's heartbeat reports for them, in heartbeat units / per_unit. A heartbeat
    with no per-gateway split (an idle worker) gives only its total, `reported`: then the
    larger of that and what the gateways know."""
    synced = sum(peers.values()) if peers else 0.0
    if not hb.load_by_gateway:
        return max(reported / per_unit, own_load + synced)
    others = sum(n for gateway, n in hb.load_by_gateway.items()
                 if gateway != own and not (peers and gateway in peers))
    return own_load + synced + others / per_unit


@dataclass
class PeerLoad:
    """Another gateway's in-flight load, as its latest RouterSync said."""

    received_at: float  # local monotonic clock
    inflight: dict[str, int]  # worker_id -> requests
    inflight_blocks: dict[str, int]  # worker_id -> prompt blocks still to prefill


class WorkerRegistry:
    def __init__(self, timeout_s: float, weights: RouterWeights | None = None,
                 own_subject: str = "", gap_s: float = 2.0) -> None:
        self.timeout_s = timeout_s
        self.gap_s = gap_s  # heartbeats this far apart: the worker was cut off (resumed_at)
        self._heard_at = 0.0  # the last heartbeat of any worker
        self.weights = weights or RouterWeights()
        self.own_subject = own_subject  # this gateway's reply subject, as heartbeats name it
        self.workers: dict[str, WorkerState] = {}
        self.peers: dict[str, PeerLoad] = {}  # other gateways' synced load, by inbox subject
        self.peer_fresh_s = 2.0  # older than this, a peer's sync gives way to heartbeats
        self._rng = random.Random(0)
        self._changes = 0  # heartbeats and refusals seen: live()'s cache is of one count
        self._live: dict[Role, tuple[int, float, list[WorkerState]]] = {}
        self._turns = {Role.PREFILL: itertools.count(), Role.DECODE: itertools.count()}

    def observe(self, hb: WorkerHeartbeat) -> None:
        self._changes += 1
        state = self.workers.get(hb.worker_id)
        if state is None or state.heartbeat.epoch != hb.epoch:  # new, or restarted
            self.workers[hb.worker_id] = WorkerState(hb, time.monotonic(), draining=hb.draining)
        else:
            now = time.monotonic()
            # (only where other heartbeats came meanwhile: a gap in all of them is this
            # gateway's own, a stalled loop or its connection, which the bus handles)
            if now - state.seen_at > self.gap_s and now - self._heard_at < self.gap_s or \
                    hb.reconnects > state.heartbeat.reconnects:  # (or its own connection)
                state.resumed_at = now
            state.heartbeat, state.seen_at = hb, now
            state.draining = state.draining or hb.draining  # (a late older heartbeat: still)
        self._heard_at = time.monotonic()

    def mark_draining(self, worker_id: str) -> bool:
        """`worker_id` refused a request because it is draining: route nothing more there, at
        once rather than at its next heartbeat. False if the worker is unknown."""
        state = self.workers.get(worker_id)
        if state is None:
            return False
        state.draining = True
        self._changes += 1
        return True

    # -- this gateway's own load on each worker (fresh, exact) ------------------------------
    def acquire(self, decode: WorkerState, prefill: WorkerState | None,
                prefill_blocks: int) -> None:
        """A request was routed to these workers; prefill_blocks: what it will compute there."""
        decode.inflight += 1
        if prefill is not None:
            prefill.inflight += 1
            prefill.inflight_blocks += prefill_blocks

    def prefill_done(self, prefill_id: str, prefill_blocks: int) -> None:
        """The request's first token came back: its blocks no longer queue at the prefill."""
        state = self.workers.get(prefill_id)
        if state is not None:
            state.inflight_blocks = max(0, state.inflight_blocks - prefill_blocks)

    def release(self, decode_id: str | None, prefill_id: str | None,
                prefill_blocks: int) -> None:
        """The request left these workers (finished, failed or re-routed)."""
        for worker_id in (prefill_id, decode_id):
            state = self.workers.get(worker_id or "")
            if state is not None and state.inflight > 0:
                state.inflight -= 1
        if prefill_id:
            self.prefill_done(prefill_id, prefill_blocks)

    def epoch_of(self, worker_id: str) -> str | None:
        """The epoch `worker_id` heartbeats under now (None: unknown)."""
        state = self.workers.get(worker_id)
        return state.heartbeat.epoch if state is not None else None

    def resumed_at(self, worker_id: str) -> float:
        """When `worker_id`'s heartbeats last came back after a gap (0: never)."""
        state = self.workers.get(worker_id)
        return state.resumed_at if state is not None else 0.0

    def is_live(self, worker_id: str) -> bool:
        state = self.workers.get(worker_id)
        return state is not None and time.monotonic() - state.seen_at < self.timeout_s

    def live(self, role: Role) -> list[WorkerState]:
        """Workers of `role` that heartbeat and take new work (not draining, not unhealthy);
        worked out at most every LIVE_CACHE_S unless a heartbeat or a refusal changed
        something (it is asked several times a request)."""
        now = time.monotonic()
        cached = self._live.get(role)
        if cached is not None and cached[0] == self._changes and now - cached[1] < LIVE_CACHE_S:
            return cached[2]
        found = sorted((s for s in self.workers.values()
                        if s.heartbeat.role == role and s.takes_work
                        and now - s.seen_at < self.timeout_s),
                       key=lambda s: s.worker_id)
        self._live[role] = (self._changes, now, found)
        return found

    def other_numerics(self, decode_id: str) -> set[str]:
        """For a stream moving off `decode_id` after some tokens: where that worker is
        batch-invariant (its heartbeat's numerics, e.g. "deterministic float32"), the live
        decode workers whose numerics differ and could continue the stream with other text.
        The caller excludes them as a preference (with none of the same numerics live, the
        stream still goes on elsewhere)."""
        state = self.workers.get(decode_id)
        numerics = state.heartbeat.numerics if state is not None else ""
        if not numerics:
            return set()
        return {s.worker_id for s in self.live(Role.DECODE) if s.heartbeat.numerics != numerics}

    def _pick(self, role: Role, candidates: list[WorkerState], total_blocks: int,
              matched: Mapping[str, float], load: dict[str, float]) -> WorkerState | None:
        if not candidates:
            return None
        if self.weights.policy == "round_robin":
            return candidates[next(self._turns[role]) % len(candidates)]
        if self.weights.policy == "least_load":
            return min(candidates, key=lambda c: (load[c.worker_id], c.worker_id))
        return choose(candidates, total_blocks, matched, load, self.weights, self._rng)

    def pick_decode(self, total_blocks: int, matched: Mapping[str, float],
                    exclude: set[str]) -> WorkerState | None:
        """A decode worker with KV room; with `kv`, one holding the conversation wins ties
        against load (it can prefill the rest locally)."""
        candidates = [s for s in self.live(Role.DECODE) if s.worker_id not in exclude
                      and s.heartbeat.free_kv_blocks >= total_blocks + 1]
        peers = self._fresh_peers()
        load = {s.worker_id: self.weights.decode_load * current_load(
            s.heartbeat, self.own_subject, s.inflight, s.heartbeat.running + s.heartbeat.waiting,
            peers=_at(peers, s.worker_id, False)) for s in candidates}
        return self._pick(Role.DECODE, candidates, total_blocks, matched, load)

    def pick_prefill(self, total_blocks: int, matched: Mapping[str, float],
                     block_size: int) -> WorkerState | None:
        candidates = self.live(Role.PREFILL)
        peers = self._fresh_peers()
        load = {s.worker_id: current_load(s.heartbeat, self.own_subject, s.inflight_blocks,
                                          s.heartbeat.queued_prompt_tokens, block_size,
                                          peers=_at(peers, s.worker_id, True))
                for s in candidates}
        return self._pick(Role.PREFILL, candidates, total_blocks, matched, load)

    def _fresh_peers(self) -> list[tuple[str, PeerLoad]]:
        if not self.peers:
            return []
        now = time.monotonic()
        return [(g, p) for g, p in self.peers.items() if now - p.received_at < self.peer_fresh_s]


def _at(peers: list[tuple[str, PeerLoad]], worker_id: str, blocks: bool) -> dict[str, float]:
    """gateway -> its synced load on `worker_id` (requests, or prompt blocks to prefill)."""
    return {g: float((p.inflight_blocks if blocks else p.inflight).get(worker_id, 0))
            for g, p in peers}
