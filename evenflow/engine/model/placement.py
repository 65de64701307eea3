"""Expert placement inside the engine: logical experts mapped to physical slots on (virtual)
expert-parallel ranks. Each (token, expert) pair goes to one replica of its expert, chosen by
the placement's per-replica shares; replicas hold identical weights, so which one serves a token
never changes the output. Real multi-process EP is a later step: here the ranks are virtual,
but the slots, the routing and the per-slot counts are the real thing."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_GOLDEN = 0.6180339887498949  # low-discrepancy sequence: spreads pairs evenly over replicas


@dataclass(frozen=True)
class SlotPlacement:
    phy2log: Tensor  # (P,) logical expert held by each physical slot
    log2phy: Tensor  # (E, R) the expert's slots, -1 padded
    cum_share: Tensor  # (E, R) cumulative routing share over the expert's replicas (pads: 1)
    num_ranks: int  # slots are rank-major: rank r holds P / num_ranks consecutive slots

    @staticmethod
    def build(phy2log: Tensor, num_experts: int, num_ranks: int,
              share: Tensor | None = None, local_ranks: list[int] | None = None
              ) -> SlotPlacement:
        """phy2log (P,), share (P,) per-slot share of its expert's tokens (even if None).
        local_ranks: the ranks on this rank's host, when the group spans hosts: an expert
        with a replica among them is routed to those replicas only (by their shares), so its
        rows do not cross hosts; the others to all their replicas."""
        P = phy2log.shape[0]
        check_slots(phy2log, num_experts, num_ranks)
        phy2log = phy2log.long()
        counts = torch.bincount(phy2log, minlength=num_experts)
        if share is None:
            share = 1.0 / counts[phy2log].float()
        if local_ranks is not None and len(local_ranks) < num_ranks:
            here = torch.isin(torch.arange(P) // (P // num_ranks), torch.tensor(local_ranks))
            local = torch.bincount(phy2log[here], minlength=num_experts)
            share = torch.where((local[phy2log] > 0) & ~here, 0.0, share.float())
            share = torch.where(here & (share <= 0), 1e-6, share)  # (a local one is used)
        R = int(counts.max())
        order = torch.argsort(phy2log, stable=True)  # slots grouped by expert
        rank = torch.arange(P) - (torch.cumsum(counts, 0) - counts)[phy2log[order]]
        log2phy = torch.full((num_experts, R), -1, dtype=torch.long)
        log2phy[phy2log[order], rank] = order
        shares = torch.zeros(num_experts, R)
        shares[phy2log[order], rank] = share[order].float()
        cum = torch.cumsum(shares, dim=1)
        cum = torch.where(log2phy >= 0, cum / cum.gather(1, (counts - 1).unsqueeze(1)), 1.0)
        return SlotPlacement(phy2log, log2phy, cum, num_ranks)

    @property
    def num_slots(self) -> int:
        return self.phy2log.shape[0]

    def slots_for(self, experts: Tensor) -> Tensor:
        """experts (N,) logical ids of (token, expert) pairs -> (N,) physical slots."""
        u = torch.frac(torch.arange(experts.shape[0], dtype=torch.float64) * _GOLDEN).float()
        replica = (u.unsqueeze(1) >= self.cum_share[experts]).sum(1)
        replica = replica.clamp_max(self.log2phy.shape[1] - 1)
        return self.log2phy[experts, replica]


def check_slots(phy2log: Tensor, num_experts: int, num_ranks: int) -> None:
    """ValueError unless phy2log (slots,) names known experts only, gives every expert a slot
    and splits evenly over the ranks."""
    if phy2log.shape[0] % num_ranks or phy2log.shape[0] < num_experts:
        raise ValueError(f"{phy2log.shape[0]} slots do not split over {num_ranks} ranks "
                         f"with a slot for each of {num_experts} experts")
    if bool(((phy2log < 0) | (phy2log >= num_experts)).any()):
        raise ValueError("placement names an unknown expert")
    if len(torch.unique(phy2log)) < num_experts:
        raise ValueError("placement leaves an expert without a slot")


def rank_balancedness(slot_counts: Tensor, num_ranks: int) -> float:
    """mean / max tokens per rank, per layer, averaged: slot_counts (layers, P)."""
    loads = slot_counts.float().view(slot_counts.shape[0], num_ranks, -1).sum(-1)
    busy = loads.sum(1) > 0
    if not bool(busy.any()):
        return 1.0
    loads = loads[busy]
    return float((loads.mean(1) / loads.max(1).values).mean())
