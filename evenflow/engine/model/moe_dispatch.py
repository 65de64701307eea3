"""Expert parallelism's dispatch and combine for one MoE layer: each (token, slot) pair goes
to the rank holding its slot (all-to-all), the rank's own experts compute it (a callback: the
MoE layer's grouped experts, engine/model/moe.py), and it comes back (all-to-all) to be weighted
and summed where the token lives. The split is vLLM's modular MoE: prepare/finalize (here) vs
the experts (there). EPTimer keeps each rank's compute and collective time for the balancer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from evenflow.parallel.group import ProcessGroup

# The rank's own experts over the rows it received: (rows, their local slots, slots per rank)
# -> their outputs, row for row
OwnExperts = Callable[[Tensor, Tensor, int], Tensor]


@dataclass
class EPTimer:
    """One expert-parallel rank's MoE time, split into its own experts' compute and the
    dispatch/combine collectives (which include waiting for the slowest rank), and the
    (token, expert) rows it computed; summed over layers until taken."""

    compute_s: float = 0.0
    wait_s: float = 0.0
    rows: int = 0

    def add(self, compute_s: float, wait_s: float, rows: int) -> None:
        self.compute_s += compute_s
        self.wait_s += wait_s
        self.rows += rows

    def take(self) -> list[float]:
        values = [self.compute_s, self.wait_s, float(self.rows)]
        self.compute_s = self.wait_s = 0.0
        self.rows = 0
        return values


def dispatch_and_combine(ep: ProcessGroup, x: Tensor, groups: Tensor, weights: Tensor,
                         top_k: int, num_slots: int, experts: OwnExperts,
                         timer: EPTimer | None) -> Tensor:
    """x (T, H) with each (token, k) pair's slot `groups` (T * k,) and routing `weights` (T, k)
    -> (T, H): the pairs through the ranks holding their slots, weighted and summed. Every rank
    calls this once per layer and step, with or without tokens (collectives must meet)."""
    started = time.perf_counter()
    per_rank = num_slots // ep.world_size
    first = ep.rank * per_rank
    dest = groups // per_rank
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=ep.world_size)
    receive = ep.all_gather(send)[:, ep.rank].tolist()  # rows each rank sends here
    sent = send.tolist()
    rows = ep.all_to_all(x[order // top_k], sent)
    local = ep.all_to_all(groups[order], sent) - first
    dispatched = time.perf_counter()
    ys = experts(rows, local, per_rank) if len(rows) else torch.empty_like(rows)
    computed = time.perf_counter()
    back = ep.all_to_all(ys, receive)
    if timer is not None:
        timer.add(computed - dispatched, dispatched - started + time.perf_counter() - computed,
                  len(rows))
    back = (back.float() * weights.flatten()[order].unsqueeze(1)).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, order // top_k, back)
