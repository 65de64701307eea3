"""Collectives over several hosts: shared memory inside each host, gloo between one leader per
host. all_reduce: shm all_reduce on each host, gloo all_reduce among the leaders, shm broadcast
from each leader. all_gather: the same shape (every host must hold the same number of ranks).
Hosts may hold different numbers of ranks (a group that lost some re-forms that way).
all_to_all (the MoE dispatch and combine): rows for a rank on the same host go by shared
memory only; rows for other hosts go to the host's leader (shm), between leaders (one gloo
all_to_all, each host pair's rows in one message), and from the receiving leader to their
ranks (shm) — the result is the flat all_to_all's, row for row.

`spanning_group(membership)` makes the group an elastic rendezvous (parallel/rendezvous.py)
formed: torch.distributed over the rendezvous store, hosts discovered, and a plain shm group
when every member turned out to share one host.

A "host" is whatever the caller declares (`hosts[rank]`), so one machine can play two;
`discover_hosts()` finds them instead: ranks whose machine, boot and /dev/shm are the same
share a host (a private /dev/shm, as on a simulated host, is another host).
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import os
import socket
import struct
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from evenflow.parallel.gloo import GlooGroup
from evenflow.parallel.rendezvous import Membership
from evenflow.parallel.shm import DEFAULT_SLOT_BYTES, ShmGroup

# An all_to_all moving more than this per rank (on average) goes flat, rank to rank over gloo:
# through the leaders it costs two more shm copies of every crossing row, which outweigh the
# fewer messages from about 1-4 MiB up (`evenflow bench comm --hosts 2`: hierarchical 1.00x
# flat at 1 MiB, 0.29x at 16 MiB).
FLAT_ALL_TO_ALL_ABOVE = 2 << 20


class HierarchicalGroup:
    def __init__(self, name: str, rank: int, hosts: list[str], timeout_s: float = 30.0,
                 slot_bytes: int | None = None) -> None:
        """`hosts[r]`: the host of global rank r; torch.distributed's default group (every rank)
        must be up already (gloo.init_default). slot_bytes: the host's shm slot (an
        all_to_all's leader receives every local rank's rows bound for other hosts)."""
        self.rank, self.world_size = rank, len(hosts)
        names = sorted(set(hosts))
        self.local_ranks = [r for r, h in enumerate(hosts) if h == hosts[rank]]
        self.most_local = max(hosts.count(h) for h in names)
        leaders = [min(r for r, h in enumerate(hosts) if h == host) for host in names]
        self.leader = self.local_ranks[0] == rank
        self.local = ShmGroup(f"{name}-{names.index(hosts[rank])}",
                              self.local_ranks.index(rank), len(self.local_ranks),
                              slot_bytes=slot_bytes or DEFAULT_SLOT_BYTES, timeout_s=timeout_s)
        self.leaders = GlooGroup(leaders, timeout_s)  # every rank joins new_group, as required
        self.flat = GlooGroup(None, timeout_s)  # every rank (the default group)
        self.hosts = hosts
        # hosts in the leaders group's order (GlooGroup orders its ranks)
        self.host_order = sorted(names, key=lambda h: hosts.index(h))

    @property
    def timeout_s(self) -> float:
        return self.local.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        """The shm waits' limit (gloo's was fixed when its group was made)."""
        self.local.timeout_s = value

    def all_reduce(self, tensor: Tensor) -> Tensor:
        self.local.all_reduce(tensor)
        if self.leader:
            self.leaders.all_reduce(tensor)
        return self.local.broadcast(tensor, 0)

    def reduce_scatter(self, tensor: Tensor) -> Tensor:
        summed = self.all_reduce(tensor.clone())
        return summed.tensor_split(self.world_size)[self.rank].clone()

    def broadcast(self, tensor: Tensor, src: int = 0, patient: bool = False) -> Tensor:
        """(Through an all_gather: not a hot path. patient: only the shm waits are.)"""
        tensor.copy_(self.all_gather(tensor, patient=patient)[src])
        return tensor

    def all_gather(self, tensor: Tensor, nap_after_s: float = 0.0,
                   patient: bool = False) -> Tensor:
        """nap_after_s / patient: how the shm waits on this host wait (ShmGroup.all_gather)."""
        local = self.local.all_gather(tensor, nap_after_s=nap_after_s, patient=patient)
        out = torch.empty(self.world_size, *tensor.shape, dtype=tensor.dtype)
        if self.leader:
            if len(local) < self.most_local:  # every leader sends as many rows
                local = torch.cat([local, local.new_zeros(self.most_local - len(local),
                                                          *tensor.shape)])
            gathered = self.leaders.all_gather(local)  # (hosts, local ranks, ...)
            for h, host in enumerate(self.host_order):  # (the leaders group's order)
                for i, r in enumerate(r for r, x in enumerate(self.hosts) if x == host):
                    out[r] = gathered[h, i]
        return self.local.broadcast(out, 0)

    def all_to_all(self, tensor: Tensor, send_counts: list[int]) -> Tensor:
        """The flat all_to_all's result (rows from rank 0, then rank 1, ...), moving rows
        between hosts once, leader to leader."""
        W, me, hosts = self.world_size, self.rank, self.hosts
        matrix = self.all_gather(torch.tensor(send_counts, dtype=torch.int64))
        rows = tensor.contiguous()
        row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
        if int(matrix.sum()) * row_bytes > FLAT_ALL_TO_ALL_ABOVE * W:  # (the same on every rank)
            return self.flat.all_to_all(rows, send_counts, matrix)
        counts = matrix.tolist()
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
        self.flat.close()


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


def spanning_group(membership: Membership, slot_bytes: int, timeout_s: float
                   ) -> HierarchicalGroup | ShmGroup:
    """The group of an epoch the rendezvous formed: torch.distributed's default group over the
    rendezvous store (gloo), then hierarchical across the hosts the members discover, or plain
    shared memory when they all share one."""
    if dist.is_initialized():  # (a process joins one epoch: a new one is a new process)
        dist.destroy_process_group()
    if "GLOO_SOCKET_IFNAME" not in os.environ:  # (an operator's choice stands)
        interface = interface_towards(membership.address.rpartition(":")[0])
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    dist.init_process_group("gloo", store=membership.prefix_store(), rank=membership.rank,
                            world_size=membership.size, timeout=timedelta(seconds=timeout_s))
    hosts = discover_hosts()
    name = f"{membership.name}-e{membership.epoch}"
    if len(set(hosts)) == 1:
        return ShmGroup(name, membership.rank, membership.size, slot_bytes=slot_bytes,
                        timeout_s=timeout_s)
    return HierarchicalGroup(name, membership.rank, hosts, timeout_s, slot_bytes)


def interface_towards(host: str) -> str | None:
    """The network interface this machine reaches `host` through (Linux): gloo's default,
    the address the machine's name resolves to, need not be reachable from the other hosts
    (a container, a network namespace, a name bound to 127.0.1.1)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # (UDP: no packet is sent)
            local = probe.getsockname()[0]
        for _, name in socket.if_nameindex():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                request = struct.pack("256s", name.encode()[:15])
                try:
                    address = fcntl.ioctl(s.fileno(), 0x8915, request)[20:24]  # SIOCGIFADDR
                except OSError:
                    continue
                if socket.inet_ntoa(address) == local:
                    return name
    except OSError:
        return None
    return None


def discover_hosts() -> list[str]:
    """Every rank's host (an opaque id, equal for ranks sharing one), from an all-gather over
    torch.distributed's default group (started with gloo.init_default): fixed-size digests,
    no pickled objects."""
    digest = hashlib.sha256(host_identity().encode()).digest()
    mine = torch.tensor(list(digest), dtype=torch.uint8)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [bytes(t.tolist()).hex()[:16] for t in every]
