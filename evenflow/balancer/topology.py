"""Topology-aware expert placement: expert-parallel ranks on several hosts.

In DEP every rank routes its own tokens, and the engine sends a (token, expert) pair to a
replica of the expert on its own host when there is one (engine/model/placement.py,
`local_ranks`), to any replica otherwise. So where an expert's replicas sit decides which rows
cross hosts (dispatch there and combine back). This module measures that, per layer, from the
load each host's ranks route (`load_by_host`, [hosts, layers, experts]), and improves a
placement for it: starting from a balanced placement (eplb.py), it swaps slots between hosts —
a replica of a hot expert moves to the host its load comes from, in exchange for a slot there —
while each layer's balancedness (under the same host-first routing) stays within `tolerance` of
where it started.
"""

from __future__ import annotations

import torch
from torch import Tensor


def host_routing(load_by_host: Tensor, phy2log: Tensor, num_gpus: int,
                 rank_host: Tensor, host_first: bool = True) -> tuple[Tensor, Tensor]:
    """(rank loads [L, G], rows crossing hosts [L]) when each host's rows go to its own
    replicas of an expert (evenly) if it has any, to all of the expert's replicas otherwise;
    host_first False: to all replicas evenly always (routing that ignores hosts)."""
    H, L, E = load_by_host.shape
    P = phy2log.shape[1]
    slot_host = rank_host[torch.arange(P) // (P // num_gpus)]  # [P]
    every = torch.zeros(L, E).scatter_add_(1, phy2log, torch.ones(L, P))
    slot_load = torch.zeros(L, P)
    cross = torch.zeros(L)
    for h in range(H):
        here = (slot_host == h).float().expand(L, P)
        local = torch.zeros(L, E).scatter_add_(1, phy2log, here)  # replicas on host h
        even = 1.0 / every.gather(1, phy2log)
        if host_first:
            has_local = local.gather(1, phy2log) > 0  # [L, P]: the slot's expert is on h
            share = torch.where(has_local, here / local.gather(1, phy2log).clamp_min(1), even)
            # rows for an expert with no replica on h all cross; the others stay on h
            away = (local == 0).float()
        else:
            share, away = even, 1.0 - local / every
        slot_load += load_by_host[h].float().gather(1, phy2log) * share
        cross += (load_by_host[h].float() * away).sum(1)
    return slot_load.view(L, num_gpus, -1).sum(-1), cross


def _balancedness(loads: Tensor) -> Tensor:
    """mean / max per layer [L]."""
    return loads.mean(1) / loads.max(1).values.clamp_min(1e-12)


def topology_aware(phy2log: Tensor, load_by_host: Tensor, num_gpus: int, rank_host: Tensor,
                   tolerance: float = 0.02, candidates: int = 8, max_moves: int = 32
                   ) -> Tensor:
    """phy2log [L, P] with fewer rows crossing hosts: per layer, greedy swaps of a slot of a
    hot expert (on another host) with a slot on the host whose load it is, each the swap that
    cuts crossing rows the most while the layer's balancedness stays >= its start - tolerance.
    `candidates`: (host, expert) pairs tried per move, heaviest first."""
    H = load_by_host.shape[0]
    P = phy2log.shape[1]
    slot_host = rank_host[torch.arange(P) // (P // num_gpus)]
    out = phy2log.clone()
    for layer in range(phy2log.shape[0]):
        load = load_by_host[:, layer : layer + 1]  # [H, 1, E]

        def metrics(row: Tensor, load: Tensor = load) -> tuple[float, float]:
            loads, cross = host_routing(load, row.unsqueeze(0), num_gpus, rank_host)
            return float(cross[0]), float(_balancedness(loads)[0])

        row = out[layer].clone()
        cross, balance = metrics(row)
        floor = balance - tolerance
        for _ in range(max_moves):
            held = torch.zeros(H, load.shape[2], dtype=torch.bool)
            held[slot_host, row] = True  # host h holds expert e
            wanted = torch.where(held, 0.0, load[:, 0].float())  # load that must cross
            if float(wanted.max()) <= 0:
                break
            best: tuple[float, int, int] | None = None
            top = torch.topk(wanted.flatten(), min(candidates, wanted.numel()))
            for value, flat in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                if value <= 0:
                    break
                h, e = divmod(flat, wanted.shape[1])
                sources = ((row == e) & (slot_host != h)).nonzero().flatten().tolist()
                targets = (slot_host == h).nonzero().flatten().tolist()
                for s in sources:
                    for t in targets:
                        trial = row.clone()
                        trial[s], trial[t] = row[t], row[s]
                        c, b = metrics(trial)
                        if b >= floor and c < cross - 1e-9 and (best is None or c < best[0]):
                            best = (c, s, t)
                if best is not None:
                    break  # the heaviest candidate that could move, moved
            if best is None:
                break
            cross, s, t = best
            row[s], row[t] = row[t].clone(), row[s].clone()
        out[layer] = row
    return out


def cross_host_bytes_per_step(load_by_host: Tensor, phy2log: Tensor, num_gpus: int,
                              rank_host: Tensor, row_bytes: int, steps: float) -> float:
    """Bytes crossing hosts per step: each crossing row goes out (dispatch) and comes back
    (combine); load_by_host counts `steps` steps' rows."""
    _, cross = host_routing(load_by_host, phy2log, num_gpus, rank_host)
    return float(cross.sum()) * 2 * row_bytes / max(steps, 1e-9)


class HostLoads:
    """Where a role's expert load comes from, as its expert-parallel ranks report it: each
    rank's host and place in its group (as the group runs now), and the load each host's
    ranks routed, decayed per report so it follows the recent workload."""

    DECAY = 0.8

    def __init__(self) -> None:
        self.rank_host: dict[int, str] = {}  # rank in the group -> host id
        self.group_size = 0
        self.load: dict[str, Tensor] = {}  # host -> [L, E] decayed
        self.steps: dict[int, float] = {}  # rank -> decayed steps

    def add(self, ep_rank: int, ep_size: int, host: str, logical: Tensor,
            steps: int) -> None:
        if ep_rank < 0 or not host:
            return
        if ep_size != self.group_size:  # the group re-formed: forget the old layout
            self.rank_host, self.load, self.steps = {}, {}, {}
            self.group_size = ep_size
        if self.rank_host.get(ep_rank, host) != host:  # another group with another layout
            self.load = {}
        self.rank_host[ep_rank] = host
        old = self.load.get(host)
        self.load[host] = logical if old is None or old.shape != logical.shape \
            else old * self.DECAY + logical
        self.steps[ep_rank] = self.steps.get(ep_rank, 0.0) * self.DECAY + steps

    def view(self) -> tuple[Tensor, Tensor, float] | None:
        """(load_by_host [H, L, E], rank_host [G], steps of one rank) when every rank of a
        group spanning several hosts has reported; None otherwise."""
        hosts = sorted(set(self.rank_host.values()))
        if len(hosts) < 2 or len(self.rank_host) != self.group_size or \
                any(h not in self.load for h in hosts):
            return None
        rank_host = torch.tensor([hosts.index(self.rank_host[r])
                                  for r in range(self.group_size)])
        steps = max(self.steps.values(), default=0.0)  # (ranks step in lockstep)
        return torch.stack([self.load[h] for h in hosts]), rank_host, steps
