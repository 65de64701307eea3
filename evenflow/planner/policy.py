"""The planner's arithmetic, pure: from the fleet's load over the last interval and the roles'
cost profile, how many prefill and decode workers the TTFT and ITL targets need (`need`), the
split of a fixed number of workers that leaves neither role the straggler (`best_split`), and
when a change is worth making (`Planner.decide`: a gain held for consecutive intervals, or at
once when a target is being missed; one worker moved per decision).

The model, per role (targets planned at `HEADROOM` of the SLA):
  prefill  a request's service time is its prompt x seconds per token; a worker at utilization
           rho waits about service x rho / (2 (1 - rho)) before it (M/D/1), so the TTFT target
           bounds rho; the work is the prompt tokens arriving per second (and the queue, to be
           cleared within one TTFT) x seconds per token.
  decode   a step of b streams takes base + b x per-seq seconds, one token per stream: the ITL
           target bounds b, and the streams the fleet holds need that many workers; prompts
           prefilled at decode workers (short ones) add their compute time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
    local_prefill_threshold: int = 0  # (a prompt this short never reaches a prefill worker)

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
    decode = load.decode_streams / streams_per_worker \
        + load.local_prompt_tokens_per_s * s_tok / MAX_UTILIZATION
    rho = work / load.prefill_workers if load.prefill_workers else math.inf
    ttft = service + (service * rho / (2 * (1 - rho)) if rho < 1 else math.inf) \
        if service else 0.0
    itl = profile.itl_s(load.decode_streams / load.decode_workers) \
        if load.decode_workers else math.inf
    return Need(prefill, decode, ttft, itl)


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
    action: str  # "hold", or "to_prefill" / "to_decode": move one worker that way
    reason: str


@dataclass
class Planner:
    """Decides each interval. A move is made when the best split lowers the straggler's
    pressure by at least `min_gain` and has for `hold_intervals` decisions in a row; at once
    when the current split misses a target (pressure above 1) and the move helps."""

    ttft_s: float
    itl_s: float
    min_gain: float = 0.15
    hold_intervals: int = 2
    min_prefill: int = 1
    _wanted: tuple[int, int] = (-1, 0)  # (the split wanted, decisions in a row)

    def decide(self, load: FleetLoad, profile: RoleProfile) -> Decision:
        needed = need(load, profile, self.ttft_s, self.itl_s)
        p, total = load.prefill_workers, load.total
        if total < 2:
            return Decision(p, load.decode_workers, needed, "hold", "fewer than two workers")
        best = best_split(total, needed, p, self.min_prefill)
        now = pressure(needed.prefill, needed.decode, p, total - p)
        then = pressure(needed.prefill, needed.decode, best, total - best)
        if best == p or needed.prefill + needed.decode <= 0:
            self._wanted = (-1, 0)
            return Decision(p, total - p, needed, "hold", f"split {p}P/{total - p}D is best "
                            f"(pressure {now:.2f})")
        held = self._wanted[1] + 1 if self._wanted[0] == best else 1
        self._wanted = (best, held)
        gain = 1 - then / now if now > 0 and math.isfinite(now) else 1.0
        urgent = now > 1.0
        if gain < self.min_gain or (held < self.hold_intervals and not urgent):
            return Decision(best, total - best, needed, "hold",
                            f"{best}P/{total - best}D would give pressure {then:.2f} against "
                            f"{now:.2f} ({held} of {self.hold_intervals} intervals)")
        action = "to_prefill" if best > p else "to_decode"
        return Decision(best, total - best, needed, action,
                        f"pressure {now:.2f} at {p}P/{total - p}D, {then:.2f} at "
                        f"{best}P/{total - best}D (prefill needs {needed.prefill:.2f} workers, "
                        f"decode {needed.decode:.2f})")
