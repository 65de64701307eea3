"""Balancing on time: a weight read every replica pays whole is packed, never split; and the
EP step simulator runs from Zipf or from a recorded live trace, printing every policy."""

from __future__ import annotations

import json

import torch

from evenflow.balancer.eplb import rebalance_experts
from evenflow.bench.experts.ep_sim import Shape, load_trace, simulate


def rank_time(phy2log: torch.Tensor, rows: torch.Tensor, reads: torch.Tensor,
              ranks: int) -> float:
    """The slowest rank's time: per slot, its expert's rows over its replicas plus a read."""
    counts = torch.bincount(phy2log[0], minlength=rows.shape[1]).float()
    per_slot = rows[0, phy2log[0]] / counts[phy2log[0]] + reads[0, phy2log[0]]
    return float(per_slot.view(ranks, -1).sum(1).max())


def test_packing_on_time_counts_each_replicas_weight_read():
    rows = torch.tensor([[6.0, 5.0, 1.0, 0.0]])
    reads = torch.tensor([[0.0, 0.0, 0.0, 6.0]])  # expert 3: few tokens, but read every step
    on_tokens = rebalance_experts(rows, 4, 1, 1, 2).phy2log
    on_time = rebalance_experts(rows, 4, 1, 1, 2, fixed=reads).phy2log
    assert rank_time(on_tokens, rows, reads, 2) == 12.0  # experts 0 and 3 land together
    assert rank_time(on_time, rows, reads, 2) == 11.0  # the best split there is


def test_simulation_from_a_recorded_trace(tmp_path):
    trace = tmp_path / "load.json"
    trace.write_text(json.dumps({"model": "test", "load": [[900, 50, 20, 10, 5, 5, 5, 5]] * 2}))
    shape = Shape(layers=4, experts=64, tokens_per_rank=16)
    lines = simulate([16], shape, trace=load_trace(str(trace)), window_steps=8)
    assert "load traced live (2 layers x 8 experts)" in lines[0]
    rows = {line.split(maxsplit=1)[1].rsplit(maxsplit=3)[0].strip(): float(line.split()[-1][:-1])
            for line in lines[2:]}
    assert set(rows) == {"static", "DeepSeek reference", "ours (+ shares)", "ours, on time",
                         "on time, reads split"}
    assert rows["ours (+ shares)"] > 1.1  # a skewed trace: placement pays against static
