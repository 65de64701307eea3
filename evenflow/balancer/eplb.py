"""Expert-parallel load balancing (EPLB): where each MoE layer's experts live on the EP ranks.

One entry point with DeepSeek EPLB's interface, so either can stand in for the other:

    rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
        weight: [layers, num_logical_experts] load per expert (tokens)
        -> phy2log [layers, num_replicas]      logical expert held by each physical slot
           log2phy [layers, num_logical_experts, max_replicas]   its slots, padded with -1
           logcnt  [layers, num_logical_experts]                 replicas per expert

Slots are numbered GPU-major: GPU g holds slots [g * per_gpu, (g + 1) * per_gpu).
Hierarchical policy (when groups divide evenly over nodes): pack expert groups onto nodes,
replicate hot experts within each node, pack replicas onto the node's GPUs. Global policy
otherwise: replicate over all slots, pack onto all GPUs. Both are greedy (hot first, into the
lightest rank with room) and then refined by swaps between the heaviest and lightest ranks.
Everything is vectorized across layers: the Python loops run over items, never over layers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class Placement(NamedTuple):
    phy2log: Tensor  # [layers, num_replicas]
    log2phy: Tensor  # [layers, num_logical, max_replicas], -1 padded
    logcnt: Tensor  # [layers, num_logical]


def balanced_packing(weight: Tensor, num_packs: int, refine_steps: int = 64
                     ) -> tuple[Tensor, Tensor]:
    """Pack n items per layer into `num_packs` packs of exactly n / num_packs items each,
    evening out pack weights. weight [L, n] -> (pack [L, n], rank within pack [L, n])."""
    L, n = weight.shape
    assert n % num_packs == 0, "items must divide evenly into packs"
    cap = n // num_packs
    w = weight.double()
    if cap == 1:
        order = w.argsort(dim=1, descending=True)
        pack = torch.empty(L, n, dtype=torch.long).scatter_(1, order, torch.arange(n).expand(L, n))
        return pack, torch.zeros(L, n, dtype=torch.long)
    rows = torch.arange(L)
    order = w.argsort(dim=1, descending=True)
    pack_w = torch.zeros(L, num_packs, dtype=torch.double)
    pack_n = torch.zeros(L, num_packs, dtype=torch.long)
    pack = torch.empty(L, n, dtype=torch.long)
    for j in range(n):  # greedy: heaviest item first, into the lightest pack with room
        item = order[:, j]
        p = torch.where(pack_n >= cap, torch.inf, pack_w).argmin(dim=1)
        pack[rows, item] = p
        pack_w[rows, p] += w[rows, item]
        pack_n[rows, p] += 1
    pack = _refine(w, pack, num_packs, refine_steps)
    # rank within pack: position among the pack's items (by item index)
    onehot = torch.nn.functional.one_hot(pack, num_packs)  # [L, n, P]
    rank = (onehot.cumsum(dim=1) - 1).gather(2, pack.unsqueeze(2)).squeeze(2)
    return pack, rank


def _refine(w: Tensor, pack: Tensor, num_packs: int, steps: int) -> Tensor:
    """Swap one item of the heaviest pack with one of the lightest when that lowers the
    heavier of the two, in every layer at once, up to `steps` times."""
    L, n = w.shape
    cap = n // num_packs
    rows = torch.arange(L)
    for _ in range(steps):
        loads = torch.zeros(L, num_packs, dtype=w.dtype).scatter_add_(1, pack, w)
        heavy, light = loads.argmax(dim=1), loads.argmin(dim=1)
        gap = (loads[rows, heavy] - loads[rows, light]).view(L, 1, 1)
        grouped = pack.argsort(dim=1, stable=True).view(L, num_packs, cap)  # items by pack
        h_items, l_items = grouped[rows, heavy], grouped[rows, light]  # [L, cap]
        delta = w.gather(1, h_items).unsqueeze(2) - w.gather(1, l_items).unsqueeze(1)
        # a swap helps iff 0 < delta < gap; the best one brings both packs nearest gap / 2
        score = torch.where((delta > 1e-9) & (delta < gap - 1e-9), (delta - gap / 2).abs(),
                            torch.inf).view(L, -1)
        best = score.argmin(dim=1)
        improve = torch.isfinite(score[rows, best])
        if not bool(improve.any()):
            break
        r = rows[improve]
        a = h_items[r, best[improve] // cap]
        b = l_items[r, best[improve] % cap]
        pack[r, a], pack[r, b] = light[improve], heavy[improve]
    return pack


def replicate_experts(weight: Tensor, num_phy: int) -> tuple[Tensor, Tensor, Tensor]:
    """Give the hottest experts extra replicas until there are `num_phy` slots.
    weight [L, n_log] -> (phy2log [L, num_phy], replica rank [L, num_phy], logcnt [L, n_log]).
    (Only the load replicas split counts here: a per-replica fixed cost is never reduced by
    another replica, so it plays no part in choosing them, only in packing them.)"""
    L, n_log = weight.shape
    assert num_phy >= n_log
    rows = torch.arange(L)
    phy2log = torch.arange(num_phy).repeat(L, 1) % n_log
    rank = torch.zeros(L, num_phy, dtype=torch.long)
    logcnt = torch.ones(L, n_log, dtype=torch.long)
    w = weight.double()
    for slot in range(n_log, num_phy):
        hot = (w / logcnt).argmax(dim=1)
        phy2log[:, slot] = hot
        rank[:, slot] = logcnt[rows, hot]
        logcnt[rows, hot] += 1
    return phy2log, rank, logcnt


def _inverse(perm: Tensor) -> Tensor:
    inv = torch.empty_like(perm)
    return inv.scatter_(1, perm, torch.arange(perm.shape[1]).expand_as(perm))


def _hierarchical(weight: Tensor, num_phy: int, num_groups: int, num_nodes: int,
                  num_gpus: int, refine_steps: int = 64, fixed: Tensor | None = None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    L, n_log = weight.shape
    assert n_log % num_groups == 0 and num_groups % num_nodes == 0
    assert num_gpus % num_nodes == 0 and num_phy % num_gpus == 0
    group_size = n_log // num_groups
    groups_per_node = num_groups // num_nodes
    per_gpu = num_phy // num_gpus
    # 1. groups -> nodes
    group_w = weight.unflatten(-1, (num_groups, group_size)).sum(-1)  # [L, G]
    gpack, grank = balanced_packing(group_w, num_nodes, refine_steps)
    log2mlog = (((gpack * groups_per_node + grank) * group_size).unsqueeze(-1)
                + torch.arange(group_size)).flatten(-2)  # node-major "meta-logical" order
    mlog2log = _inverse(log2mlog)
    # 2. replicate within each node
    mlog_w = weight.gather(-1, mlog2log).view(-1, n_log // num_nodes)  # [L*nodes, n/nodes]
    mlog_f = (torch.zeros_like(mlog_w) if fixed is None
              else fixed.float().gather(-1, mlog2log).view(-1, n_log // num_nodes))
    phy2mlog, phyrank, mlogcnt = replicate_experts(mlog_w, num_phy // num_nodes)
    # 3. replicas -> the node's GPUs
    phy_w = (mlog_w / mlogcnt + mlog_f).gather(-1, phy2mlog)
    pack, rank = balanced_packing(phy_w, num_gpus // num_nodes, refine_steps)
    pphy2phy = _inverse(pack * per_gpu + rank)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy)
    pphy2mlog = (pphy2mlog.view(L, num_nodes, -1)
                 + torch.arange(0, n_log, n_log // num_nodes).view(1, -1, 1)).flatten(-2)
    phy2log = mlog2log.gather(-1, pphy2mlog)
    phy_rank = phyrank.gather(-1, pphy2phy).view(L, -1)
    logcnt = mlogcnt.view(L, -1).gather(-1, log2mlog)
    return phy2log, phy_rank, logcnt


def rebalance_experts(weight: Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int, refine_steps: int = 64, fixed: Tensor | None = None
                      ) -> Placement:
    """DeepSeek EPLB's interface (see the module docstring). refine_steps=0 leaves out our
    refinement: DeepSeek's reference policy (greedy packing only). `fixed` [L, n_log]: a
    per-replica cost that replication does not split (an expert's weight read, when balancing
    on time rather than tokens); None balances on `weight` alone."""
    assert weight.dim() == 2 and num_replicas >= weight.shape[1]
    weight = weight.float().cpu()
    if num_groups % num_nodes == 0:
        phy2log, rank, logcnt = _hierarchical(weight, num_replicas, num_groups, num_nodes,
                                              num_gpus, refine_steps, fixed)
    else:
        phy2log, rank, logcnt = _hierarchical(weight, num_replicas, 1, 1, num_gpus,
                                              refine_steps, fixed)
    return Placement(phy2log, _log2phy(phy2log, rank, logcnt), logcnt)


def _log2phy(phy2log: Tensor, rank: Tensor, logcnt: Tensor) -> Tensor:
    L, num_phy = phy2log.shape
    max_rep = int(logcnt.max())
    log2phy = torch.full((L, logcnt.shape[1] * max_rep), -1, dtype=torch.long)
    log2phy.scatter_(1, phy2log * max_rep + rank, torch.arange(num_phy).expand(L, -1))
    return log2phy.view(L, -1, max_rep)


def rank_loads(weight: Tensor, phy2log: Tensor, num_gpus: int,
               slot_share: Tensor | None = None) -> Tensor:
    """Load per EP rank [L, num_gpus]: each slot carries its expert's load times its share
    (even split over replicas unless `slot_share` [L, num_phy] says otherwise)."""
    L, num_phy = phy2log.shape
    if slot_share is None:
        counts = torch.zeros(L, weight.shape[1]).scatter_add_(
            1, phy2log, torch.ones(L, num_phy))
        slot_share = 1.0 / counts.gather(1, phy2log)
    slot_load = weight.float().gather(1, phy2log) * slot_share
    return slot_load.view(L, num_gpus, -1).sum(-1)


def balancedness(weight: Tensor, phy2log: Tensor, num_gpus: int,
                 slot_share: Tensor | None = None) -> float:
    """mean / max rank load, per layer, averaged over layers (1.0 = perfectly even)."""
    loads = rank_loads(weight, phy2log, num_gpus, slot_share)
    return float((loads.mean(1) / loads.max(1).values.clamp_min(1e-12)).mean())


def replica_shares(weight: Tensor, phy2log: Tensor, num_gpus: int, iterations: int = 50,
                   step: float = 0.5) -> Tensor:
    """Per-replica routing weights [L, num_phy] (each expert's shares sum to 1): a replicated
    expert sends more of its tokens to the replicas on lighter ranks. Starts from the even
    split and moves shares toward lighter ranks, all layers at once."""
    L, num_phy = phy2log.shape
    per_gpu = num_phy // num_gpus
    gpu_of_slot = torch.arange(num_phy) // per_gpu
    n_log = weight.shape[1]
    counts = torch.zeros(L, n_log).scatter_add_(1, phy2log, torch.ones(L, num_phy))
    share = 1.0 / counts.gather(1, phy2log)
    w = weight.float().gather(1, phy2log)  # expert load at each slot
    for _ in range(iterations):
        loads = (w * share).view(L, num_gpus, per_gpu).sum(-1)  # [L, G]
        slot_gpu_load = loads[:, gpu_of_slot]  # [L, num_phy]
        target = 1.0 / slot_gpu_load.clamp_min(1e-9)
        norm = torch.zeros(L, n_log).scatter_add_(1, phy2log, target).gather(1, phy2log)
        share = (1 - step) * share + step * target / norm
    return share


def static_placement(num_logical: int, num_gpus: int, layers: int) -> Tensor:
    """Contiguous experts per GPU, no replicas: the baseline. [layers, num_logical]."""
    assert num_logical % num_gpus == 0
    return torch.arange(num_logical).repeat(layers, 1)


def rebalance_from(current: Tensor, weight: Tensor, num_gpus: int, tolerance: float = 0.01,
                   max_swaps: int = 256) -> Placement:
    """Migration-aware rebalancing: start from the `current` phy2log [L, num_phy] and move
    only what the balance needs. Replica counts are set as the fresh greedy would set them
    (each change re-purposes one slot: a cold expert's extra replica becomes a hot one's, on
    the heaviest rank), then slots are swapped between the heaviest and lightest ranks until
    balancedness is within `tolerance` of a from-scratch placement (global policy)."""
    L, num_phy = current.shape
    n_log = weight.shape[1]
    per_gpu = num_phy // num_gpus
    w = weight.double()
    _, _, want = replicate_experts(weight, num_phy)  # [L, n_log] target replica counts
    phy2log = current.clone()
    have = torch.zeros(L, n_log, dtype=torch.long).scatter_add_(
        1, phy2log, torch.ones(L, num_phy, dtype=torch.long))
    rows = torch.arange(L)
    for _ in range(num_phy):  # one re-purposed slot per layer per pass
        surplus, deficit = have - want, want - have
        needy = deficit.argmax(dim=1)  # [L]
        act = deficit[rows, needy] > 0
        if not bool(act.any()):
            break
        slot_surplus = surplus.gather(1, phy2log) > 0  # [L, num_phy] slots we may take
        loads = rank_loads(weight, phy2log, num_gpus)  # [L, G]
        slot_rank_load = loads.repeat_interleave(per_gpu, dim=1)
        pick = torch.where(slot_surplus, slot_rank_load, -torch.inf).argmax(dim=1)
        r = rows[act]
        old = phy2log[r, pick[act]]
        have[r, old] -= 1
        have[r, needy[act]] += 1
        phy2log[r, pick[act]] = needy[act]
    target = balancedness(weight, rebalance_experts(weight, num_phy, 1, 1, num_gpus).phy2log,
                          num_gpus)
    logcnt = torch.zeros(L, n_log).scatter_add_(1, phy2log, torch.ones(L, num_phy)).long()
    slot_w = (w / logcnt.double()).gather(1, phy2log)  # [L, num_phy]
    home = torch.arange(num_phy).repeat(L, 1) // per_gpu  # each slot's GPU now
    pack = home.clone()
    for _ in range(max_swaps // 8):
        loads = torch.zeros(L, num_gpus, dtype=torch.double).scatter_add_(1, pack, slot_w)
        if float((loads.mean(1) / loads.max(1).values).mean()) >= target - tolerance:
            break
        pack = _swap_off_heaviest(slot_w, pack, num_gpus, 8)
    # Slots that changed GPU trade places pairwise: arrivals take the slots others vacated.
    for layer in range(L):
        moved = pack[layer] != home[layer]
        if bool(moved.any()):
            vacated = moved.nonzero().squeeze(1)  # already in GPU order
            arriving = vacated[pack[layer, vacated].argsort(stable=True)]
            phy2log[layer, vacated] = phy2log[layer, arriving].clone()
    rank = _replica_rank(phy2log)
    return Placement(phy2log, _log2phy(phy2log, rank, logcnt), logcnt)


def _swap_off_heaviest(w: Tensor, pack: Tensor, num_packs: int, steps: int) -> Tensor:
    """Like _refine, but the heaviest pack may swap with any other pack: the swap that
    lowers the larger of the two packs the most."""
    L, n = w.shape
    cap = n // num_packs
    rows = torch.arange(L)
    for _ in range(steps):
        loads = torch.zeros(L, num_packs, dtype=w.dtype).scatter_add_(1, pack, w)
        heavy = loads.argmax(dim=1)
        h_load = loads[rows, heavy].view(L, 1, 1)
        h_items = pack.argsort(dim=1, stable=True).view(L, num_packs, cap)[rows, heavy]
        other_load = loads.gather(1, pack).unsqueeze(1)  # [L, 1, n]: load of b's pack
        delta = w.gather(1, h_items).unsqueeze(2) - w.unsqueeze(1)  # [L, cap, n]
        new_max = torch.maximum(h_load - delta, other_load + delta)
        ok = (delta > 1e-9) & (new_max < h_load - 1e-9)
        score = torch.where(ok, new_max, torch.inf).view(L, -1)
        best = score.argmin(dim=1)
        improve = torch.isfinite(score[rows, best])
        if not bool(improve.any()):
            break
        r = rows[improve]
        a, b = h_items[r, best[improve] // n], best[improve] % n
        pack[r, a], pack[r, b] = pack[r, b], heavy[improve]
    return pack


def _replica_rank(phy2log: Tensor) -> Tensor:
    """The k-th slot (in slot order) of an expert gets rank k."""
    onehot = torch.nn.functional.one_hot(phy2log, int(phy2log.max()) + 1)  # [L, P, E]
    return (onehot.cumsum(dim=1) - 1).gather(2, phy2log.unsqueeze(2)).squeeze(2)


def slots_moved(before: Tensor, after: Tensor) -> int:
    """Slots whose expert changed (each one is an expert's weights copied in)."""
    return int((before != after).sum())
