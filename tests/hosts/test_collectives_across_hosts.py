"""Collectives between ranks on two simulated hosts (2 ranks each): the ranks find which of them
share a host (not told), and the hierarchical group's all_to_all — shared memory inside a host,
one gloo message per host pair between leaders — returns the flat gloo all_to_all's rows, row
for row; its all_reduce sums over both hosts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # four rank processes over two hosts: ~15 s

RANK = r"""
import json, sys, torch
from evenflow.parallel import gloo
from evenflow.parallel.hierarchical import HierarchicalGroup, discover_hosts
rank, world, address, name = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.set_num_threads(1)
gloo.init_default(rank, world, address, timeout_s=60)
hosts = discover_hosts()
group = HierarchicalGroup(name, rank, hosts, timeout_s=60)
flat = gloo.GlooGroup(None, 60)
g = torch.Generator().manual_seed(rank)
equal = []
for trial in range(4):
    counts = torch.randint(0, 6, (world,), generator=g).tolist()
    if trial == 3:
        counts = [0] * world  # a rank with nothing to send
    x = torch.randn(sum(counts), 8, generator=g).to(torch.bfloat16 if trial == 2 else torch.float32)
    equal.append(bool(torch.equal(group.all_to_all(x, counts), flat.all_to_all(x, counts))))
total = group.all_reduce(torch.full((3,), float(rank + 1)))
group.close()
print(json.dumps({"hosts": hosts, "equal": equal, "sum": total.tolist()}))
"""


def test_hierarchical_all_to_all_over_two_hosts(three_hosts):
    a, b, _ = three_hosts.hosts
    placement = [a, a, b, b]
    address = f"{a.address}:29511"
    # gloo finds its own address through the host name, which resolves to the machine's, not
    # the simulated host's: name the interface (as on real hosts with several NICs)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0"}
    procs = [host.popen([sys.executable, "-c", RANK, str(rank), "4", address, "evh-a2a"],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank, host in enumerate(placement)]
    try:
        outs = [proc.communicate(timeout=90) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for proc, (out, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    hosts = results[0]["hosts"]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3]  # found, not declared
    assert all(r["hosts"] == hosts for r in results)
    for r in results:
        assert r["equal"] == [True] * 4
        assert r["sum"] == [10.0] * 3
