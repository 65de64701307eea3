"""Collectives over several hosts: shared memory inside each host, gloo between one leader per
host. all_reduce: shm all_reduce on each host, gloo all_reduce among the leaders, shm broadcast
from each leader. all_gather: the same shape (every host must hold the same number of ranks).
A "host" is whatever the caller declares (`hosts[rank]`), so one machine can play two.
"""

from __future__ import annotations

import torch
from torch import Tensor

from evenflow.parallel.gloo import GlooGroup
from evenflow.parallel.shm import ShmGroup


class HierarchicalGroup:
    def __init__(self, name: str, rank: int, hosts: list[str], timeout_s: float = 30.0) -> None:
        """`hosts[r]`: the host of global rank r; torch.distributed's default group (every rank)
        must be up already (gloo.init_default)."""
        self.rank, self.world_size = rank, len(hosts)
        names = sorted(set(hosts))
        self.local_ranks = [r for r, h in enumerate(hosts) if h == hosts[rank]]
        if any(hosts.count(h) != len(self.local_ranks) for h in names):
            raise ValueError("every host must hold the same number of ranks")
        leaders = [min(r for r, h in enumerate(hosts) if h == host) for host in names]
        self.leader = self.local_ranks[0] == rank
        self.local = ShmGroup(f"{name}-{names.index(hosts[rank])}",
                              self.local_ranks.index(rank), len(self.local_ranks),
                              timeout_s=timeout_s)
        self.leaders = GlooGroup(leaders, timeout_s)  # every rank joins new_group, as required
        self.hosts = hosts

    def all_reduce(self, tensor: Tensor) -> Tensor:
        self.local.all_reduce(tensor)
        if self.leader:
            self.leaders.all_reduce(tensor)
        return self.local.broadcast(tensor, 0)

    def all_gather(self, tensor: Tensor) -> Tensor:
        local = self.local.all_gather(tensor)  # (local ranks, ...)
        out = torch.empty(self.world_size, *tensor.shape, dtype=tensor.dtype)
        if self.leader:
            gathered = self.leaders.all_gather(local)  # (hosts, local ranks, ...)
            names = sorted(set(self.hosts))
            for h, host in enumerate(names):
                for i, r in enumerate(r for r, x in enumerate(self.hosts) if x == host):
                    out[r] = gathered[h, i]
        return self.local.broadcast(out, 0)

    def barrier(self) -> None:
        self.local.barrier()
        if self.leader:
            self.leaders.barrier()
        self.local.barrier()

    def close(self) -> None:
        self.local.close()
        self.leaders.close()
