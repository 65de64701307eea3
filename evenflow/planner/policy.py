"""The planner's arithmetic, pure: from the fleet's load over the last interval and the roles'
cost profile, how many prefill and decode workers the TTFT and ITL targets need (`need`), the
split of a fixed number of workers that leaves neither role the straggler (`best_split`), and
when a change is worth making (`Planner.decide`: a gain held for consecutive intervals, or at
once when a target is being missed); or, for a fleet that can grow and shrink, how many of
each role to run (`Planner.size`: up at once, down only after the need stayed lower for a
while).

The model, per role (targets planned at `HEADROOM` of the SLA):
  prefill  a request's service time is its prompt x seconds per token; a worker at utilization
           rho waits about service x rho / (2 (1 - rho)) before it (M/D/1), so the TTFT target
           bounds rho; the work is the prompt tokens arriving per second (and the queue, to be
           cleared within one TTFT) x seconds per token.
  decode   a step of b streams takes base + b x per-seq seconds, one token per stream: the ITL
           target bounds b, hence the tokens a second one worker generates within it; the
           fleet's tokens a second (or the streams it holds, when it is saturated and they
           queue) need that many workers; prompts prefilled at decode workers (short ones) add
           their compute time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from evenflow.planner.profile import RoleProfile

HEADROOM = 0.8  # plan for this share of each target
MAX_UTILIZATION = 0.9


@dataclass(frozen=True)
class FleetLoad:
    """What the heartbeats said over the last interval, summed over live workers."""

    prefill_workers: int
    decode_workers: int
    prompt_tokens_per_s: float = 0.0  # computed at prefill workers
    prefill_requests_per_s: float = 0.0  # first tokens prefill workers sent
    queued_prompt_tokens: float = 0.0  # waiting at prefill workers now
    local_prompt_tokens_per_s: float = 0.0  # prefilled at decode workers (short prompts)
    decode_streams: float = 0.0  # running + waiting at decode workers now
    decode_tokens_per_s: float = 0.0  # generated at decode workers

    @property
    def total(self) -> int:
        return self.prefill_workers + self.decode_workers


@dataclass(frozen=True)
class Need:
    """Workers each role needs for the targets (fractional), and what the current split would
    give: estimated TTFT and ITL."""

    prefill: float
    decode: float
    ttft_s: float
    itl_s: float


def max_utilization(service_s: float, ttft_s: float) -> float:
    """The highest prefill utilization whose queueing wait plus service fits the TTFT budget
    (M/D/1 mean wait: service x rho / (2 (1 - rho)))."""
    budget = HEADROOM * ttft_s
    if service_s <= 0:
        return MAX_UTILIZATION
    if service_s >= budget:
        return 0.5  # the target cannot be met by adding workers: keep them half busy
    k = (budget - service_s) / service_s
    return min(MAX_UTILIZATION, 2 * k / (1 + 2 * k))


def need(load: FleetLoad, profile: RoleProfile, ttft_s: float, itl_s: float) -> Need:
    s_tok = profile.prefill_s_per_token
    prompt = load.prompt_tokens_per_s / load.prefill_requests_per_s \
        if load.prefill_requests_per_s > 0 else 0.0
    service = prompt * s_tok
    rho_max = max_utilization(service, ttft_s)
    work = (load.prompt_tokens_per_s + load.queued_prompt_tokens / ttft_s) * s_tok
    prefill = work / rho_max
    per_stream_budget = HEADROOM * itl_s - profile.decode_s_base
    streams_per_worker = max(1.0, per_stream_budget / profile.decode_s_per_seq) \
        if profile.decode_s_per_seq > 0 else math.inf
    # Streams held (Little's law: what a saturated fleet's queue shows) or tokens generated (a
    # fleet with room runs few streams fast: its rate is the demand), against what a worker
    # carries at the ITL target.
    tokens_per_worker = streams_per_worker / profile.itl_s(streams_per_worker) \
        if math.isfinite(streams_per_worker) else math.inf
    decode = max(load.decode_streams / streams_per_worker,
                 load.decode_tokens_per_s / tokens_per_worker) \
        + load.local_prompt_tokens_per_s * s_tok / MAX_UTILIZATION
    rho = work / load.prefill_workers if load.prefill_workers else math.inf
    ttft = service + (service * rho / (2 * (1 - rho)) if rho < 1 else math.inf) \
        if service else 0.0
    itl = profile.itl_s(load.decode_streams / load.decode_workers) \
        if load.decode_workers else math.inf
    return Need(prefill, decode, ttft, itl)


def describe(load: FleetLoad) -> str:
    """The load in a few words, for the planner's log lines."""
    return (f"{load.prompt_tokens_per_s:.0f} prompt tok/s, {load.queued_prompt_tokens:.0f} "
            f"queued; {load.decode_tokens_per_s:.0f} output tok/s, "
            f"{load.decode_streams:.0f} streams")


def pressure(need_prefill: float, need_decode: float, prefill: int, decode: int) -> float:
    """The straggler role's load against its capacity (1.0: exactly at the targets)."""
    return max(need_prefill / prefill if prefill else (math.inf if need_prefill > 0 else 0.0),
               need_decode / decode if decode else math.inf)


def best_split(total: int, needed: Need, current_prefill: int, min_prefill: int = 1
               ) -> int:
    """The prefill count of `total` workers (at least one decode worker) whose straggler role
    is least loaded; ties keep the split nearest the current one."""
    candidates = range(min(min_prefill, total - 1), total)
    return min(candidates, key=lambda p: (pressure(needed.prefill, needed.decode, p, total - p),
                                          abs(p - current_prefill)))


@dataclass
class Decision:
    target_prefill: int
    target_decode: int
    needed: Need
    action: str  # "hold", or "to_prefill" / "to_decode": move workers that way, to the split
    reason: str


@dataclass
class RateSmoother:
    """A load's rates smoothed over intervals (`weight`: the newest's); queues and streams
    are taken as they are now."""

    weight: float
    _last: FleetLoad | None = None

    def smooth(self, load: FleetLoad) -> FleetLoad:
        a, old = self.weight, self._last
        if old is not None:
            load = replace(load, **{name: a * getattr(load, name) + (1 - a) * getattr(old, name)
                                    for name in ("prompt_tokens_per_s", "prefill_requests_per_s",
                                                 "local_prompt_tokens_per_s",
                                                 "decode_tokens_per_s")})
        self._last = load
        return load


@dataclass
class Planner:
    """Decides each interval. While the straggler role's pressure is under `busy_pressure`
    nothing moves. A move is made when the best split lowers the straggler's
    pressure by at least `min_gain` and has for `hold_intervals` decisions in a row; at once
    when the current split misses a target (pressure above 1) and the move helps, unless it
    undoes a move of the last `settle_intervals` (a backlog the last move released shows up
    at the other role for a while: it must hold like any other change). Rates are smoothed
    over intervals (`smoothing`: the weight of the newest); queues and streams are taken as
    they are now."""

    ttft_s: float
    itl_s: float
    min_gain: float = 0.15
    hold_intervals: int = 2
    settle_intervals: int = 4
    busy_pressure: float = 0.7  # below this at the current split, nothing moves
    smoothing: float = 0.5
    min_prefill: int = 1
    _wanted: tuple[int, int] = (-1, 0)  # (the split wanted, decisions in a row)
    _rates: RateSmoother | None = None
    _decisions: int = 0
    _last_move: tuple[str, int] = ("", -1000)  # (action, the decision it was made at)

    def smooth(self, load: FleetLoad) -> FleetLoad:
        if self._rates is None:
            self._rates = RateSmoother(self.smoothing)
        return self._rates.smooth(load)

    def moved(self, action: str) -> None:
        """The caller carried out `action` (the last decision's)."""
        self._last_move = (action, self._decisions)
        self._wanted = (-1, 0)

    def decide(self, load: FleetLoad, profile: RoleProfile) -> Decision:
        self._decisions += 1
        load = self.smooth(load)
        needed = need(load, profile, self.ttft_s, self.itl_s)
        p, total = load.prefill_workers, load.total
        if total < 2:
            return Decision(p, load.decode_workers, needed, "hold", "fewer than two workers")
        best = best_split(total, needed, p, self.min_prefill)
        now = pressure(needed.prefill, needed.decode, p, total - p)
        then = pressure(needed.prefill, needed.decode, best, total - best)
        if now < self.busy_pressure:  # every role within its targets, with room: no churn
            self._wanted = (-1, 0)
            return Decision(p, total - p, needed, "hold", f"pressure {now:.2f} at "
                            f"{p}P/{total - p}D: room for the load")
        if best == p or needed.prefill + needed.decode <= 0:
            self._wanted = (-1, 0)
            return Decision(p, total - p, needed, "hold", f"split {p}P/{total - p}D is best "
                            f"(pressure {now:.2f})")
        held = self._wanted[1] + 1 if self._wanted[0] == best else 1
        self._wanted = (best, held)
        gain = 1 - then / now if now > 0 and math.isfinite(now) else 1.0
        action = "to_prefill" if best > p else "to_decode"
        last, at = self._last_move
        undoing = last and last != action and self._decisions - at <= self.settle_intervals
        urgent = now > 1.0 and not undoing
        if gain < self.min_gain or (held < self.hold_intervals and not urgent):
            return Decision(best, total - best, needed, "hold",
                            f"{best}P/{total - best}D would give pressure {then:.2f} against "
                            f"{now:.2f} ({held} of {self.hold_intervals} intervals)")
        return Decision(best, total - best, needed, action,
                        f"pressure {now:.2f} at {p}P/{total - p}D, {then:.2f} at "
                        f"{best}P/{total - best}D (prefill needs {needed.prefill:.2f} workers, "
                        f"decode {needed.decode:.2f}; {describe(load)})")


def fleet_size(needed: Need, max_workers: int, current_prefill: int) -> tuple[int, int]:
    """(prefill, decode) workers for the need: each role rounded up, at least one each, and at
    most `max_workers` in all (then the best split of that many)."""
    prefill, decode = max(1, math.ceil(needed.prefill - 1e-9)), \
        max(1, math.ceil(needed.decode - 1e-9))
    if prefill + decode > max_workers >= 2:
        prefill = best_split(max_workers, needed, current_prefill)
        decode = max_workers - prefill
    return prefill, decode


@dataclass
class Sizer:
    """A fleet that can grow and shrink (`planner_mode` scale): the sizes each role needs,
    raised at once and lowered only once the need has stayed lower for `settle_intervals`
    decisions in a row (to the largest size those asked for: no flapping). At `max_workers`
    a role that needs more takes them from the other at once. Rates are smoothed as
    Planner's are."""

    ttft_s: float
    itl_s: float
    max_workers: int
    settle_intervals: int = 4
    smoothing: float = 0.5
    target: tuple[int, int] | None = None  # (prefill, decode) as last decided
    _lower: list[tuple[int, int]] = field(default_factory=list)  # sizes asked while lower
    _rates: RateSmoother | None = None

    def decide(self, load: FleetLoad, profile: RoleProfile) -> Decision:
        if self._rates is None:
            self._rates = RateSmoother(self.smoothing)
        load = self._rates.smooth(load)
        needed = need(load, profile, self.ttft_s, self.itl_s)
        current = self.target or (max(1, load.prefill_workers), max(1, load.decode_workers))
        wanted = fleet_size(needed, self.max_workers, current[0])
        why = (f"prefill needs {needed.prefill:.2f} workers, decode {needed.decode:.2f}; "
               f"{describe(load)}")
        if wanted[0] >= current[0] and wanted[1] >= current[1]:
            self._lower.clear()
            target = wanted
        else:  # a role would shrink: only after it has asked for less long enough
            self._lower.append(wanted)
            held = (max(current[0], wanted[0]), max(current[1], wanted[1]))
            if len(self._lower) < self.settle_intervals and sum(held) <= self.max_workers:
                target = self.target = held
                return Decision(*target, needed, _resize_action(current, target),
                                f"{why} ({len(self._lower)} of {self.settle_intervals} "
                                "intervals lower)")
            target = (max(w[0] for w in self._lower), max(w[1] for w in self._lower))
            if sum(target) > self.max_workers:  # at the cap one role gives way to the other
                target = wanted
            self._lower.clear()
        self.target = target
        return Decision(*target, needed, _resize_action(current, target), why)


def _resize_action(current: tuple[int, int], target: tuple[int, int]) -> str:
    """"hold", "grow" (more workers in all), "shrink" (fewer) or "resize" (as many)."""
    if target == current:
        return "hold"
    return "grow" if sum(target) > sum(current) else "shrink" if sum(target) < sum(current) \
        else "resize"
