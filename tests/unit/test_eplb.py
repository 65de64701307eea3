import pytest
import torch

from evenflow.balancer.eplb import (
    balancedness,
    rebalance_experts,
    rebalance_from,
    replica_shares,
    slots_moved,
    static_placement,
)
from evenflow.balancer.policy import ThresholdTrigger, TriggerConfig
from evenflow.bench.experts.eplb_bench import zipf_load


def zipf(layers, experts, s, seed=0):
    return zipf_load(layers, experts, s, seed, tokens=10000).round()


def check_consistent(p, num_logical, num_replicas):
    L = p.phy2log.shape[0]
    assert p.phy2log.shape == (L, num_replicas)
    assert p.logcnt.shape == (L, num_logical) and bool((p.logcnt >= 1).all())
    assert int(p.logcnt.sum(1).unique()) == num_replicas
    for layer in range(L):
        for e in range(num_logical):
            slots = sorted((p.phy2log[layer] == e).nonzero().flatten().tolist())
            assert len(slots) == p.logcnt[layer, e]
            listed = p.log2phy[layer, e]
            assert sorted(listed[listed >= 0].tolist()) == slots
            assert bool((listed[len(slots):] == -1).all())


@pytest.mark.parametrize("groups, nodes, gpus, replicas", [(4, 2, 8, 16), (1, 1, 8, 24),
                                                           (3, 2, 4, 16)])
def test_maps_are_consistent_and_every_expert_is_placed(groups, nodes, gpus, replicas):
    w = zipf(5, 12, 1.0)
    p = rebalance_experts(w, replicas, groups, nodes, gpus)
    check_consistent(p, 12, replicas)


def test_documented_example_is_at_least_as_balanced():
    # The example in DeepSeek EPLB's README: 2 layers, 12 experts, 16 replicas, 4 groups,
    # 2 nodes, 8 GPUs, and the placement it documents.
    weight = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                           [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    documented = torch.tensor([[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                               [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]])
    ours = rebalance_experts(weight, 16, 4, 2, 8)
    check_consistent(ours, 12, 16)
    assert balancedness(weight, ours.phy2log, 8) >= balancedness(weight, documented, 8) - 1e-9


def test_balances_far_better_than_a_static_placement():
    w = zipf(8, 64, 1.0)
    p = rebalance_experts(w, 80, 1, 1, 8)
    assert balancedness(w, p.phy2log, 8) > 0.97
    assert balancedness(w, static_placement(64, 8, 8), 8) < 0.6


def test_replica_shares_sum_to_one_and_never_hurt():
    w = zipf(6, 64, 1.5)
    p = rebalance_experts(w, 80, 1, 1, 8)
    share = replica_shares(w, p.phy2log, 8)
    per_expert = torch.zeros(6, 64).scatter_add_(1, p.phy2log, share)
    assert torch.allclose(per_expert, torch.ones(6, 64), atol=1e-5)
    assert balancedness(w, p.phy2log, 8, share) >= balancedness(w, p.phy2log, 8) - 1e-6


def test_migration_aware_moves_less_for_nearly_the_same_balance():
    w0 = zipf(8, 64, 1.0)
    current = rebalance_experts(w0, 96, 1, 1, 16).phy2log
    w1 = (w0 * torch.exp(torch.randn(w0.shape, generator=torch.Generator().manual_seed(1))
                         * 0.3)).round()
    fresh = rebalance_experts(w1, 96, 1, 1, 16)
    kept = rebalance_from(current, w1, 16, tolerance=0.01)
    check_consistent(kept, 64, 96)
    assert balancedness(w1, kept.phy2log, 16) >= balancedness(w1, fresh.phy2log, 16) - 0.011
    assert slots_moved(current, kept.phy2log) < slots_moved(current, fresh.phy2log) / 2


def test_threshold_trigger_waits_for_imbalance_and_the_interval():
    w = zipf(2, 16, 1.0)
    placement = rebalance_experts(w, 32, 1, 1, 4).phy2log
    assert balancedness(w, placement, 4) > 0.95
    trigger = ThresholdTrigger(TriggerConfig(threshold=0.9, min_interval=5, window=4), 4)
    assert not any(trigger.observe(w, placement) for _ in range(10))  # balanced: never
    skewed = w.roll(3, dims=1)  # the hot experts moved
    fired = [i for i in range(12) if trigger.observe(skewed, placement)]
    assert fired and fired[0] <= 4  # as soon as the window shows the skew
    # never within min_interval
    assert all(b - a >= 5 for a, b in zip(fired, fired[1:], strict=False))
