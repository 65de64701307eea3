"""`evenflow bench comm`: latency and bandwidth of the shared-memory collectives against gloo, in
one run: all-reduce, all-gather and all-to-all from 8 B to 16 MiB on 2 ranks (and 4, which
oversubscribes a 2-core machine: marked), each op timed as the median over repetitions on rank
0 after a barrier; then the DEP-style step-metadata all-reduce (4 int64s) as the rank count
grows. Ratios are gloo time / shm time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid

SIZES = [8, 64, 1024, 16 * 1024, 64 * 1024, 1024**2, 16 * 1024**2]
QUICK_SIZES = [8, 1024, 64 * 1024]
OPS = ("all_reduce", "all_gather", "all_to_all")


def _reps(nbytes: int, quick: bool) -> int:
    base = 20 if quick else 200
    return max(5, base if nbytes <= 64 * 1024 else base // 20)


def _time(fn, reps: int, barrier) -> float:
    fn()
    times = []
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _op(group, op: str, x, world: int):
    """A no-argument call of `op` on `group` with `x` (all_to_all: x's rows split evenly)."""
    if op == "all_reduce":
        return lambda: group.all_reduce(x)
    if op == "all_gather":
        return lambda: group.all_gather(x)
    rows = x.view(-1, 1)
    counts = [len(rows) // world] * world
    counts[-1] += len(rows) - sum(counts)
    return lambda: group.all_to_all(rows, counts)


def rank_main(rank: int, world: int, name: str, port: int, sizes: list[int], quick: bool,
              ops: tuple[str, ...]) -> dict:
    import torch

    from evenflow.parallel.gloo import GlooGroup, init_default
    from evenflow.parallel.group import ProcessGroup
    from evenflow.parallel.shm import ShmGroup

    torch.set_num_threads(1)
    init_default(rank, world, f"127.0.0.1:{port}")
    # slots that hold the largest message whole (all_to_all does not split into pieces)
    slot = -(-(max(sizes) + 8 * world + 4096) // 64) * 64
    shm = ShmGroup(name, rank, world, slot_bytes=slot)
    groups: dict[str, ProcessGroup] = {"shm": shm, "gloo": GlooGroup()}
    out: dict = {}
    for op in ops:
        for nbytes in sizes:
            x = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
            for backend, g in groups.items():
                out[f"{op} {backend} {nbytes}"] = _time(_op(g, op, x, world),
                                                        _reps(nbytes, quick), g.barrier)
    meta = torch.zeros(4, dtype=torch.int64)
    for backend, g in groups.items():
        out[f"meta {backend}"] = _time(lambda g=g: g.all_reduce(meta), 50 if quick else 500,
                                       g.barrier)
    shm.close()
    return out


def _human(n: int) -> str:
    for unit, size in (("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n // size} {unit}"
    return f"{n} B"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evenflow bench comm", description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ranks", default="2,4", help="rank counts for the op table")
    ap.add_argument("--meta-ranks", default="2,4,8", help="rank counts for the metadata line")
    ap.add_argument("--hosts", type=int, default=0,
                    help="instead: N simulated hosts x 2 ranks, hierarchical vs flat gloo "
                         "(root; evenflow/bench/experts/comm_hosts.py)")
    ap.add_argument("--rate", default="10gbit", help="--hosts: each link's rate")
    ap.add_argument("--delay-ms", type=float, default=1.0,
                    help="--hosts: each link's delay (needs the kernel's netem)")
    args = ap.parse_args(argv)
    if args.hosts:  # (its own process: comm_hosts builds on this module's helpers)
        import subprocess
        import sys

        return subprocess.call([sys.executable, "-m", "evenflow.bench.experts.comm_hosts",
                                str(args.hosts), json.dumps(args.quick), args.rate or "",
                                str(args.delay_ms)])

    from evenflow.bench.machine import machine_line
    from evenflow.parallel.launch import run_ranks
    from evenflow.services.launcher import free_port

    cores = os.cpu_count() or 1
    print(machine_line("float32 (int64 for the metadata all-reduce)", 1))
    sizes = QUICK_SIZES if args.quick else SIZES
    for world in [int(w) for w in args.ranks.split(",")]:
        note = f" (oversubscribed: {world} ranks on {cores} cores)" if world > cores else ""
        print(f"\n{world} ranks{note}: median latency, µs (bandwidth = bytes per rank / time)")
        res = run_ranks(rank_main, world, f"bench-{uuid.uuid4().hex[:8]}", free_port(), sizes,
                        args.quick, OPS, timeout_s=1800)[0]
        print(f"{'op':12}{'size':>9}{'shm µs':>11}{'gloo µs':>11}{'gloo/shm':>10}"
              f"{'shm GB/s':>10}")
        for op in OPS:
            for nbytes in sizes:
                shm, gloo = res[f"{op} shm {nbytes}"], res[f"{op} gloo {nbytes}"]
                print(f"{op:12}{_human(nbytes):>9}{shm * 1e6:11.1f}{gloo * 1e6:11.1f}"
                      f"{gloo / shm:9.1f}x{nbytes / shm / 1e9:10.2f}")
    print("\nstep-metadata all-reduce (4 int64), median µs")
    print(f"{'ranks':>6}{'shm':>10}{'gloo':>10}{'gloo/shm':>10}")
    for world in [int(w) for w in args.meta_ranks.split(",")]:
        res = run_ranks(rank_main, world, f"bench-{uuid.uuid4().hex[:8]}", free_port(), [8],
                        True, (), timeout_s=600)[0]
        note = " (oversubscribed)" if world > cores else ""
        shm, gloo = res["meta shm"], res["meta gloo"]
        print(f"{world:6}{shm * 1e6:10.1f}{gloo * 1e6:10.1f}{gloo / shm:9.1f}x{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
