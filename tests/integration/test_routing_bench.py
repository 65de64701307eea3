"""`evenflow bench routing --quick` runs end to end: a mock mesh, the index, its latency probe."""

import re

import pytest

from evenflow.bench.mesh import routing_bench


@pytest.mark.slow
def test_quick_routing_bench_reports_hits_for_kv_routing(capsys):
    # One session per system prompt, and histories long enough that reuse clearly outweighs
    # one more running sequence: every turn's reuse is then the router's to find.
    assert routing_bench.main(["--quick", "--policies", "kv", "--sessions", "3",
                               "--system-len", "256"]) == 0
    out = capsys.readouterr().out
    row = re.search(r"^kv\s+(\S+)\s+(\S+)\s+(\S+)\s+(\d+).*\s(\d+)\s+[\d.]+ms$", out, re.M)
    assert row, out
    hit_rate, oracle, errors = float(row.group(1)), float(row.group(2)), int(row.group(5))
    assert errors == 0
    assert oracle > 0 and hit_rate >= 0.9 * oracle  # turn 2 reuses turn 1 where it lives
    assert re.search(r"match +1024 blocks: p50 [\d.]+ ms", out)
    assert re.search(r"write throughput .*: [\d,]+ block events/s", out)
