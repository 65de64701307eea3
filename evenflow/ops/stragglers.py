"""Which worker is the straggler: each worker's cost (seconds per token, per step) against the
median of the OTHER workers of its role or group.

Against a median that counts the worker itself, two workers can never stand apart: one 2x
slower than its peer is only 1.33x the median of the two, so a 1.5x rule needed a 3x gap.
Against the others' median, that worker is 2x and its peer 0.5x; only "slower than" counts.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import NamedTuple

# A worker more than this many times its peers' median cost is named. A throttled or starved
# worker costs 2x and more; per-token timings of equal workers on a shared host differ by up
# to ~1.2x, well below.
STANDS_OUT = 1.5


class PeerComparison(NamedTuple):
    vs_peers: float  # cost / median cost of the others (1.0 alone, or when they cost nothing)
    straggler: bool  # named: over STANDS_OUT, and slower than its role's median


def against_peers(costs: Mapping[str, float], threshold: float = STANDS_OUT
                  ) -> dict[str, PeerComparison]:
    """costs: worker -> cost of one role (any unit, > 0). A straggler is more than `threshold`
    times the median of the others and above the median of all (so that one fast worker among
    three does not make the two others stragglers)."""
    assert threshold > 1, "only 'slower than' names a worker"
    everyone = statistics.median(costs.values()) if costs else 0.0
    out = {}
    for worker, cost in costs.items():
        others = [c for w, c in costs.items() if w != worker]
        median = statistics.median(others) if others else 0.0
        ratio = cost / median if median > 0 else 1.0
        out[worker] = PeerComparison(ratio, ratio > threshold and cost > everyone)
    return out


def stragglers(costs: Mapping[str, float], threshold: float = STANDS_OUT) -> list[str]:
    """The workers named, slowest first."""
    compared = against_peers(costs, threshold)
    return sorted((w for w, c in compared.items() if c.straggler),
                  key=lambda w: -compared[w].vs_peers)
