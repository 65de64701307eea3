"""The shared-memory collectives give gloo's results for every op, dtype and size (sizes that do
not divide by the rank count, and messages larger than a slot, included); the hierarchical
group over two declared "hosts" too; a missing or killed peer is an error within the timeout;
no /dev/shm entry outlives its group."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import torch

from evenflow.parallel.group import CollectiveTimeout, PeerLost
from evenflow.parallel.launch import RankFailed, run_ranks
from evenflow.parallel.shm import SHM_DIR, ShmGroup
from evenflow.services.launcher import free_port

DTYPES = [torch.float32, torch.bfloat16, torch.int64]
SIZES = [1, 7, 1000, 50_001]  # 50,001 float32 = 200 KB: several 64 KiB slot-sized pieces


def leftovers(name: str) -> list[str]:
    return [p.name for p in SHM_DIR.iterdir() if name in p.name]


def sample(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n + salt)
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, (n,), generator=g)
    return torch.randn(n, generator=g).to(dtype)


def compare_with_gloo(rank: int, world: int, name: str, port: int) -> list[str]:
    from evenflow.parallel.gloo import GlooGroup, init_default

    init_default(rank, world, f"127.0.0.1:{port}")
    shm, gloo = ShmGroup(name, rank, world, slot_bytes=1 << 16), GlooGroup()
    mismatches = []

    def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        ok = torch.equal(a, b) if world == 2 or a.dtype == torch.int64 else torch.allclose(
            a.float(), b.float(), rtol=1e-2, atol=1e-2)
        if not ok:
            mismatches.append(what)

    for dtype in DTYPES:
        for n in SIZES:
            x = sample(rank, n, dtype)
            same(shm.all_reduce(x.clone()), gloo.all_reduce(x.clone()), f"all_reduce {dtype} {n}")
            same(shm.all_gather(x), gloo.all_gather(x), f"all_gather {dtype} {n}")
            same(shm.reduce_scatter(x), gloo.reduce_scatter(x), f"reduce_scatter {dtype} {n}")
            same(shm.broadcast(x.clone(), world - 1), gloo.broadcast(x.clone(), world - 1),
                 f"broadcast {dtype} {n}")
            rows = sample(rank, 3 * (n % 50 + world), dtype, 1).view(-1, 3)
            g = torch.Generator().manual_seed(rank + n)
            cuts = sorted(torch.randint(0, rows.shape[0] + 1, (world - 1,), generator=g).tolist())
            counts = [b - a for a, b in zip([0, *cuts], [*cuts, rows.shape[0]], strict=True)]
            same(shm.all_to_all(rows, counts), gloo.all_to_all(rows, counts),
                 f"all_to_all {dtype} {counts}")
    shm.barrier()
    shm.close()
    return mismatches


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_shm_collectives_equal_gloo(world):
    name = f"test-{uuid.uuid4().hex[:8]}"
    results = run_ranks(compare_with_gloo, world, name, free_port(), timeout_s=240)
    assert results == [[]] * world
    assert leftovers(name) == []


def hierarchical(rank: int, world: int, name: str, port: int, hosts: list[str]) -> list:
    from evenflow.parallel.gloo import GlooGroup, init_default
    from evenflow.parallel.hierarchical import HierarchicalGroup

    init_default(rank, world, f"127.0.0.1:{port}")
    group = HierarchicalGroup(name, rank, hosts)
    flat = GlooGroup(None)
    summed = group.all_reduce(torch.tensor([float(rank), 1.0]))
    gathered = group.all_gather(torch.tensor([rank * 10]))
    counts = [(rank + d) % 3 for d in range(world)]
    rows = torch.arange(sum(counts) * 2, dtype=torch.float32).view(-1, 2) + 100 * rank
    same = torch.equal(group.all_to_all(rows, counts), flat.all_to_all(rows, counts))
    # above FLAT_ALL_TO_ALL_ABOVE per rank the rows go flat: the same result
    big = [(rank + d) % 3 * 400 for d in range(world)]  # 4 KiB rows: ~5 MiB per rank
    rows = torch.randn(sum(big), 1024, generator=torch.Generator().manual_seed(rank))
    same = same and torch.equal(group.all_to_all(rows, big), flat.all_to_all(rows, big))
    group.barrier()
    group.close()
    return [summed.tolist(), gathered.view(-1).tolist(), same]


# (host names that sort against the ranks' order: the leaders' group is in rank order)
@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["b", "b", "a", "a"]])
def test_hierarchical_group_over_two_declared_hosts(hosts):
    name = f"test-{uuid.uuid4().hex[:8]}"
    results = run_ranks(hierarchical, 4, name, free_port(), hosts, timeout_s=120)
    assert results == [[[6.0, 4.0], [0, 10, 20, 30], True]] * 4
    assert leftovers(name) == []


def lonely(rank: int, world: int, name: str) -> str:
    if rank == 1:
        time.sleep(30)  # never joins
    started = time.monotonic()
    try:
        ShmGroup(name, rank, world, timeout_s=1.0)
    except CollectiveTimeout:
        return f"timeout after {time.monotonic() - started:.1f}"
    return "joined"


@pytest.mark.slow
def test_a_peer_that_never_joins_is_an_error_within_the_timeout():
    name = f"test-{uuid.uuid4().hex[:8]}"
    with pytest.raises(RankFailed, match="timed out"):  # rank 1 sleeps: the run times out
        run_ranks(lonely, 2, name, timeout_s=8)
    assert leftovers(name) == []


def killed_peer(rank: int, world: int, name: str) -> str:
    group = ShmGroup(name, rank, world, timeout_s=20.0)
    group.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    try:
        group.all_reduce(torch.ones(4))
    except PeerLost:
        return f"peer lost after {time.monotonic() - started:.2f} s"
    return "no error"


def test_a_killed_peer_is_an_error_within_a_bounded_time_and_leaves_no_segment():
    name = f"test-{uuid.uuid4().hex[:8]}"
    outcome, killed = run_ranks(killed_peer, 2, name, timeout_s=30, keep_going=True)
    assert killed is None and outcome.startswith("peer lost after")
    assert float(outcome.split()[3]) < 2.0  # its timeout is 20 s: the liveness check saw it
    assert leftovers(name) == []


@pytest.mark.slow
def test_bench_comm_prints_shm_and_gloo_side_by_side(capsys):
    from evenflow.bench.experts.comm_bench import main

    assert main(["--quick", "--ranks", "2", "--meta-ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert "cpu:" in out and "gloo/shm" in out and "all_to_all" in out
    assert "step-metadata all-reduce" in out
