"""Restarting what dies: `evenflow up`'s supervision of its processes. A child that exits is
started again after a backoff that doubles with each crash (0.5 s, 1 s, 2 s, ... at most 10 s);
one that crashes more than `max_crashes` times within `window_s` is given up on, and the
supervisor says so (the caller then stops the mesh). Pure bookkeeping over `start` callables:
who the children are, and how a restarted one rejoins, is the caller's business (a worker comes
back with a new epoch, the balancer from its stored placement, the KV index by resyncing, NATS
and Redis on the same port)."""

from __future__ import annotations

import logging
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


# A child that exits with this status asked to be restarted (an elastic expert-parallel group
# re-forming): restarted at once, not counted as a crash.
EXIT_PLANNED_RESTART = 75
# An engine worker the planner moved to the other role, drained (`planner_mode` restart): the
# launcher starts it again at once, in the other role.
EXIT_ROLE_SWITCH = 76


@dataclass(frozen=True)
class RestartPolicy:
    max_crashes: int = 5
    window_s: float = 60.0
    backoff_s: float = 0.5
    max_backoff_s: float = 10.0

    def delay(self, crashes: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, crashes - 1))


@dataclass
class Child:
    name: str
    start: Callable[[], subprocess.Popen]
    proc: subprocess.Popen
    crashes: deque[float] = field(default_factory=deque)  # monotonic times, in the window
    restart_at: float | None = None  # set while it waits for its backoff
    restarts: int = 0


class GaveUp(RuntimeError):
    """A child crashed too often; the message says which and how often."""


class Supervisor:
    def __init__(self, policy: RestartPolicy | None = None,
                 report: Callable[[str], None] = log.warning) -> None:
        self.policy = policy or RestartPolicy()
        self.report = report
        self.children: list[Child] = []

    def add(self, name: str, start: Callable[[], subprocess.Popen]) -> Child:
        child = Child(name, start, start())
        self.children.append(child)
        return child

    def check(self, now: float | None = None) -> None:
        """Notice exits and restart children whose backoff is over; raises GaveUp."""
        now = time.monotonic() if now is None else now
        for child in self.children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    self._restart(child, now)
                continue
            code = child.proc.poll()
            if code == EXIT_PLANNED_RESTART:
                self.report(f"{child.name} asked to restart")
                self._restart(child, now)
            elif code == EXIT_ROLE_SWITCH:
                self.report(f"{child.name} drained for a role switch; starting it in the "
                            "other role")
                self._restart(child, now)
            elif code is not None:
                self._crashed(child, now, f"exited with code {code}")

    def _restart(self, child: Child, now: float) -> None:
        try:
            child.proc = child.start()
        except Exception as exc:  # could not even start: that is one more crash
            self._crashed(child, now, f"did not restart ({exc})")
            return
        child.restart_at = None
        child.restarts += 1
        self.report(f"{child.name} restarted")

    def _crashed(self, child: Child, now: float, what: str) -> None:
        child.crashes.append(now)
        while child.crashes and child.crashes[0] < now - self.policy.window_s:
            child.crashes.popleft()
        if len(child.crashes) > self.policy.max_crashes:
            raise GaveUp(f"{child.name} failed {len(child.crashes)} times within "
                         f"{self.policy.window_s:g} s (last: {what}); giving up")
        delay = self.policy.delay(len(child.crashes))
        child.restart_at = now + delay
        self.report(f"{child.name} {what}; restarting in {delay:g} s")
