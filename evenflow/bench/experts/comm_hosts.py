"""`evenflow bench comm --hosts N`: the collectives between simulated hosts (evenflow/dev/hosts.py:
network namespaces, a private /dev/shm each, links shaped by tc): the hierarchical group (shared
memory inside a host, gloo between one leader per host) against flat gloo over every rank, 2
ranks per host, all-reduce / all-gather / all-to-all from 8 B to 16 MiB, medians on rank 0 after
a barrier. Links: --rate (tbf) and --delay-ms (netem, where the kernel has it; where it does
not, the run says so and goes on without delay).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

from evenflow.bench.experts.comm_bench import OPS, QUICK_SIZES, SIZES, _human, _op, _reps, _time

RANKS_PER_HOST = 2


def rank_main(rank: int, world: int, address: str, name: str, sizes: list[int],
              quick: bool) -> dict:
    import torch

    from evenflow.parallel import gloo
    from evenflow.parallel.hierarchical import HierarchicalGroup, discover_hosts

    torch.set_num_threads(1)
    gloo.init_default(rank, world, address, timeout_s=120)
    # a leader's slot takes every local rank's largest message (rows for other hosts)
    slot = -(-(RANKS_PER_HOST * max(sizes) + 8 * world + 4096) // 64) * 64
    group = HierarchicalGroup(name, rank, discover_hosts(), timeout_s=120, slot_bytes=slot)
    flat = gloo.GlooGroup(None, 120)
    out: dict = {}
    for op in OPS:
        for nbytes in sizes:
            x = torch.ones(max(world, nbytes // 4), dtype=torch.float32)
            reps = _reps(nbytes, quick)
            out[f"{op}:{nbytes}"] = [_time(_op(g, op, x, world), reps, flat.barrier)
                                     for g in (group, flat)]
    group.close()
    return out


def run(hosts: int, quick: bool, rate: str | None, delay_ms: float) -> int:
    from evenflow.dev.hosts import HostsUnavailable, SimCluster

    sizes = QUICK_SIZES if quick else SIZES
    try:
        cluster = SimCluster.create(hosts, rate=rate)
    except HostsUnavailable as exc:
        print(f"bench comm --hosts: simulated hosts unavailable here: {exc}")
        return 1
    link = f"rate {rate or 'unshaped'}"
    try:
        if delay_ms:
            try:
                for host in cluster.hosts:
                    cluster.netem(host, delay_ms, rate)
                link += f", {delay_ms} ms each way"
            except HostsUnavailable as exc:
                link += f" (no delay: {exc})"
        world = hosts * RANKS_PER_HOST
        address = f"{cluster.hosts[0].address}:29533"
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0"}
        name = f"commh-{uuid.uuid4().hex[:6]}"
        procs = [cluster.hosts[r // RANKS_PER_HOST].popen(
            [sys.executable, "-m", "evenflow.bench.experts.comm_hosts", "--rank", str(r),
             str(world), address, name, json.dumps(sizes), json.dumps(quick)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for r in range(world)]
        outs = [p.communicate(timeout=1800) for p in procs]
        if procs[0].returncode:
            print(f"bench comm --hosts: rank 0 failed:\n{outs[0][1][-2000:]}")
            return 1
        result = json.loads(outs[0][0].strip().splitlines()[-1])
    finally:
        cluster.close()
    print(f"{hosts} simulated hosts x {RANKS_PER_HOST} ranks ({world} rank processes on "
          f"{os.cpu_count()} CPUs), links: {link}; medians on rank 0, ratio = flat / hierarchical")
    print(f"{'op':12} {'size':>8} {'hierarchical':>14} {'flat gloo':>12} {'ratio':>7}")
    for op in OPS:
        for nbytes in sizes:
            hier, flat = result[f"{op}:{nbytes}"]
            print(f"{op:12} {_human(nbytes):>8} {hier * 1e6:12.1f}us {flat * 1e6:10.1f}us "
                  f"{flat / hier:6.2f}x")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        r, w, addr, nm, sz, q = sys.argv[2:8]
        print(json.dumps(rank_main(int(r), int(w), addr, nm, json.loads(sz), json.loads(q))))
    elif len(sys.argv) == 5:  # from `evenflow bench comm --hosts N`: hosts, quick, rate, delay
        n, q, rate, delay = sys.argv[1:5]
        raise SystemExit(run(int(n), json.loads(q), rate or None, float(delay)))
    else:
        raise SystemExit("run through `evenflow bench comm --hosts N`")
