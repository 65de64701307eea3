"""When to rebalance: a sliding window of measured expert load, and a trigger that fires when
the current placement's balancedness on that window drops below a threshold (no more often
than a minimum interval) - rather than on a blind timer."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from torch import Tensor

from evenflow.balancer.eplb import balancedness


@dataclass
class TriggerConfig:
    threshold: float = 0.9  # rebalance when windowed balancedness falls below this
    min_interval: int = 100  # steps between rebalances, at least
    window: int = 200  # steps of load the decision and the new placement use


class LoadWindow:
    """The last `window` steps of token counts per (layer, expert), summed on demand."""

    def __init__(self, window: int) -> None:
        self.steps: deque[Tensor] = deque(maxlen=window)
        self._sum: Tensor | None = None

    def add(self, counts: Tensor) -> None:
        if len(self.steps) == self.steps.maxlen and self._sum is not None:
            self._sum -= self.steps[0]
        self.steps.append(counts.float())
        self._sum = counts.float().clone() if self._sum is None else self._sum + counts.float()

    def load(self) -> Tensor:
        assert self._sum is not None, "no load observed yet"
        return self._sum


class ThresholdTrigger:
    def __init__(self, config: TriggerConfig, num_gpus: int) -> None:
        self.config, self.num_gpus = config, num_gpus
        self.window = LoadWindow(config.window)
        self.since = 0  # steps since the last rebalance

    def observe(self, counts: Tensor, phy2log: Tensor, shares: Tensor | None = None) -> bool:
        """Add one step's counts; True when the placement (with its replica shares, if any)
        should be recomputed now."""
        self.window.add(counts)
        self.since += 1
        if self.since < self.config.min_interval or len(self.window.steps) < 2:
            return False
        load = self.window.load()
        if not bool(load.any()):
            # An idle window (no token routed): nothing to balance. Its balancedness reads 0
            # (mean / max of zeros), which fired a rebalance every min_interval reports of an
            # idle mesh, each computed for nothing and stalling the balancer's event loop.
            return False
        score = balancedness(load, phy2log, self.num_gpus, shares)
        if score >= self.config.threshold:
            return False
        self.since = 0
        return True
