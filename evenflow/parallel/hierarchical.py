"""Collectives over several hosts: shared memory inside each host, gloo between one leader per
host. all_reduce: shm all_reduce on each host, gloo all_reduce among the leaders, shm broadcast
from each leader. all_gather: the same shape (every host must hold the same number of ranks).
all_to_all (the MoE dispatch and combine): rows for a rank on the same host go by shared
memory only; rows for other hosts go to the host's leader (shm), between leaders (one gloo
all_to_all, each host pair's rows in one message), and from the receiving leader to their
ranks (shm) — the result is the flat all_to_all's, row for row.

A "host" is whatever the caller declares (`hosts[rank]`), so one machine can play two;
`discover_hosts()` finds them instead: ranks whose machine, boot and /dev/shm are the same
share a host (a private /dev/shm, as on a simulated host, is another host).
"""

from __future__ import annotations

import hashlib
import os
import socket

import torch
import torch.distributed as dist
from torch import Tensor

from evenflow.parallel.gloo import GlooGroup
from evenflow.parallel.shm import DEFAULT_SLOT_BYTES, ShmGroup


class HierarchicalGroup:
    def __init__(self, name: str, rank: int, hosts: list[str], timeout_s: float = 30.0,
                 slot_bytes: int | None = None) -> None:
        """`hosts[r]`: the host of global rank r; torch.distributed's default group (every rank)
        must be up already (gloo.init_default). slot_bytes: the host's shm slot (an
        all_to_all's leader receives every local rank's rows bound for other hosts)."""
        self.rank, self.world_size = rank, len(hosts)
        names = sorted(set(hosts))
        self.local_ranks = [r for r, h in enumerate(hosts) if h == hosts[rank]]
        if any(hosts.count(h) != len(self.local_ranks) for h in names):
            raise ValueError("every host must hold the same number of ranks")
        leaders = [min(r for r, h in enumerate(hosts) if h == host) for host in names]
        self.leader = self.local_ranks[0] == rank
        self.local = ShmGroup(f"{name}-{names.index(hosts[rank])}",
                              self.local_ranks.index(rank), len(self.local_ranks),
                              slot_bytes=slot_bytes or DEFAULT_SLOT_BYTES, timeout_s=timeout_s)
        self.leaders = GlooGroup(leaders, timeout_s)  # every rank joins new_group, as required
        self.hosts = hosts
        # hosts in the leaders group's order (GlooGroup orders its ranks)
        self.host_order = sorted(names, key=lambda h: hosts.index(h))

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
            for h, host in enumerate(self.host_order):  # (the leaders group's order)
                for i, r in enumerate(r for r, x in enumerate(self.hosts) if x == host):
                    out[r] = gathered[h, i]
        return self.local.broadcast(out, 0)

    def all_to_all(self, tensor: Tensor, send_counts: list[int]) -> Tensor:
        """The flat all_to_all's result (rows from rank 0, then rank 1, ...), moving rows
        between hosts once, leader to leader."""
        W, me, hosts = self.world_size, self.rank, self.hosts
        counts = self.all_gather(torch.tensor(send_counts, dtype=torch.int64)).tolist()
        rows = tensor.contiguous()
        empty = rows[:0]
        local = self.local_ranks
        here = hosts[me]
        remote_dsts = [d for d in range(W) if hosts[d] != here]
        chunks = list(rows.split(send_counts))
        # 1. on this host: each rank's rows for each local rank, and (to the leader) every
        #    row bound for another host
        sends = [[chunks[r]] + ([chunks[d] for d in remote_dsts] if j == 0 else [])
                 for j, r in enumerate(local)]
        got = self.local.all_to_all(_cat(sends, empty), [sum(len(c) for c in part)
                                                         for part in sends])
        from_local: dict[int, Tensor] = {}
        outbound: dict[int, list[Tensor]] = {}  # local source -> its rows per remote dst
        offset = 0
        for s in local:
            n = counts[s][me]
            from_local[s], offset = got[offset : offset + n], offset + n
            if self.leader:
                sizes = [counts[s][d] for d in remote_dsts]
                outbound[s] = list(got[offset : offset + sum(sizes)].split(sizes))
                offset += sum(sizes)
        # 2. leaders: each other host's rows in one message, ordered (dst, src)
        inbound: dict[int, list[tuple[int, Tensor]]] = {d: [] for d in local}
        if self.leader:
            index = {d: i for i, d in enumerate(remote_dsts)}
            blocks, sizes = [], []
            for host in self.host_order:
                block = [] if host == here else [outbound[s][index[d]] for d in range(W)
                                                 if hosts[d] == host for s in local]
                blocks.append(block)
                sizes.append(sum(len(b) for b in block))
            received = self.leaders.all_to_all(_cat(blocks, empty), sizes)
            offset = 0
            for host in self.host_order:
                if host == here:
                    continue
                sources = [s for s in range(W) if hosts[s] == host]
                for d in local:
                    for s in sources:
                        n = counts[s][d]
                        inbound[d].append((s, received[offset : offset + n]))
                        offset += n
        # 3. on this host: the leader hands each rank its rows from other hosts (by source)
        scatter = [[t for _, t in sorted(inbound[d], key=lambda st: st[0])] for d in local]
        got = self.local.all_to_all(_cat(scatter, empty), [sum(len(t) for t in part)
                                                           for part in scatter])
        remote_srcs = [s for s in range(W) if hosts[s] != here]
        from_remote = dict(zip(remote_srcs, got.split([counts[s][me] for s in remote_srcs]),
                               strict=True))
        return torch.cat([from_local[s] if s in from_local else from_remote[s]
                          for s in range(W)])

    def barrier(self) -> None:
        self.local.barrier()
        if self.leader:
            self.leaders.barrier()
        self.local.barrier()

    def close(self) -> None:
        self.local.close()
        self.leaders.close()


def _cat(parts: list[list[Tensor]], empty: Tensor) -> Tensor:
    flat = [t for part in parts for t in part]
    return torch.cat(flat) if flat else empty


def host_identity() -> str:
    """What ranks on one host share: the machine's name and boot, and its /dev/shm (a private
    tmpfs there — a container, a simulated host — is a host of its own: shared memory does
    not reach across it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    shm = os.stat("/dev/shm")
    return f"{socket.gethostname()}|{boot}|{shm.st_dev}:{shm.st_ino}"


def discover_hosts() -> list[str]:
    """Every rank's host (an opaque id, equal for ranks sharing one), from an all-gather over
    torch.distributed's default group (started with gloo.init_default): fixed-size digests,
    no pickled objects."""
    digest = hashlib.sha256(host_identity().encode()).digest()
    mine = torch.tensor(list(digest), dtype=torch.uint8)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [bytes(t.tolist()).hex()[:16] for t in every]
