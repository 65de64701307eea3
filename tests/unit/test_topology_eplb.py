"""Topology-aware expert placement (balancer/topology.py) for DEP groups across hosts: what
crosses hosts under host-first routing, a placement that moves hot experts' replicas to the
host their load comes from without losing balance, the engine routing a host's rows to its
own replicas, and the balancer using it when ranks report their hosts."""

from __future__ import annotations

import torch

from evenflow.balancer.eplb import rebalance_from
from evenflow.balancer.policy import TriggerConfig
from evenflow.balancer.role_balance import RoleBalance
from evenflow.balancer.topology import host_routing, topology_aware
from evenflow.engine.model.placement import SlotPlacement, check_slots
from evenflow.proto.messages import ExpertLoad

RANK_HOST = torch.tensor([0, 0, 1, 1])  # 4 ranks, 2 per host


def skewed_load(layers: int = 4, experts: int = 8) -> torch.Tensor:
    """[hosts, layers, experts]: host 0's tokens favour experts 0-1, host 1's 2-3."""
    torch.manual_seed(0)
    load = torch.rand(2, layers, experts) * 10
    load[0, :, 0:2] += 200
    load[1, :, 2:4] += 200
    return load


def test_rows_cross_hosts_only_for_experts_without_a_local_replica():
    phy2log = torch.tensor([[0, 1, 2, 3]])  # one slot per rank: 0,1 on host 0; 2,3 on host 1
    load = torch.zeros(2, 1, 4)
    load[0, 0] = torch.tensor([5.0, 0, 7, 0])  # host 0: 5 rows stay, 7 cross
    load[1, 0] = torch.tensor([1.0, 0, 0, 3])  # host 1: 1 crosses, 3 stay
    loads, cross = host_routing(load, phy2log, 4, RANK_HOST)
    assert cross.tolist() == [8.0]
    assert loads.tolist() == [[6.0, 0.0, 7.0, 3.0]]
    # experts replicated on both hosts: each host keeps its rows at home
    load[1, 0] = torch.tensor([1.0, 0, 3, 0])
    loads, cross = host_routing(load[:, :, [0, 2]], torch.tensor([[0, 1, 1, 0]]), 4, RANK_HOST)
    assert cross.tolist() == [0.0] and loads.tolist() == [[5.0, 7.0, 3.0, 1.0]]


def test_topology_aware_placement_keeps_rows_on_their_host_and_the_balance():
    load = skewed_load()
    layers, slots = load.shape[1], 12
    plain = rebalance_from((torch.arange(slots) % 8).repeat(layers, 1), load.sum(0), 4).phy2log
    topo = topology_aware(plain, load, 4, RANK_HOST, tolerance=0.02)
    for row in topo:
        check_slots(row, 8, 4)  # still a placement: every expert has a slot
    loads_plain, cross_plain = host_routing(load, plain, 4, RANK_HOST)
    loads_topo, cross_topo = host_routing(load, topo, 4, RANK_HOST)
    assert float(cross_topo.sum()) < 0.5 * float(cross_plain.sum())
    def bal(x):
        return x.mean(1) / x.max(1).values
    assert bool((bal(loads_topo) >= bal(loads_plain) - 0.02 - 1e-6).all())


def test_the_engine_routes_a_hosts_rows_to_its_own_replica():
    phy2log = torch.tensor([0, 1, 2, 3, 0, 4, 5, 6, 7, 1, 2, 3])  # 3 slots per rank
    experts = torch.tensor([1] * 20 + [0] * 20)
    everywhere = SlotPlacement.build(phy2log, 8, 4).slots_for(experts)
    on_host_1 = SlotPlacement.build(phy2log, 8, 4, local_ranks=[2, 3]).slots_for(experts)
    assert set(everywhere[:20].tolist()) == {1, 9}  # expert 1: slot 1 (rank 0), 9 (rank 3)
    assert set(on_host_1[:20].tolist()) == {9}  # host 1 keeps them on rank 3
    assert set(on_host_1[20:].tolist()) == {0, 4}  # expert 0 lives on host 0 only


def report(rank: int, load: torch.Tensor, version: int = 0) -> ExpertLoad:
    """Rank `rank`'s report: half of its host's load, on the initial placement (slot s holds
    expert s mod 8, so slot s < 8 carries expert s)."""
    counts = torch.zeros(load.shape[1], 12)
    counts[:, :8] = load[int(RANK_HOST[rank])] / 2
    return ExpertLoad(worker_id=f"d0r{rank}", version=version, num_layers=load.shape[1],
                      num_slots=12, counts=counts.flatten().long().tolist(), role="decode",
                      group="g", steps=10, ep_rank=rank, ep_size=4,
                      host=f"host-{int(RANK_HOST[rank])}")


def test_the_balancer_places_for_the_hosts_its_ranks_report():
    load = skewed_load()
    balance = RoleBalance("decode", 8, 4, TriggerConfig(threshold=0.99, min_interval=4,
                                                        window=8))
    placements = [balance.observe(report(r, load)) for _ in range(2) for r in range(4)]
    placement = next(p for p in placements if p is not None)  # (every rank reported)
    phy2log = torch.tensor(placement.phy2log).view(load.shape[1], 12)
    plain = rebalance_from((torch.arange(12) % 8).repeat(load.shape[1], 1), load.sum(0),
                           4).phy2log  # what the balancer placed before it knew hosts
    _, cross = host_routing(load, phy2log, 4, RANK_HOST)
    _, cross_plain = host_routing(load, plain, 4, RANK_HOST)
    assert float(cross.sum()) < 0.5 * float(cross_plain.sum())
    # the group re-forms with two ranks: the balancer places for two
    balance.observe(ExpertLoad(worker_id="d0r0", version=0, num_layers=load.shape[1],
                               num_slots=12, counts=[1] * 12 * load.shape[1], role="decode",
                               ep_rank=0, ep_size=2, host="host-0"))
    assert balance.num_ranks == 2
