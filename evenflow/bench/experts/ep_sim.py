"""`evenflow bench ep --simulate`: what expert placement is worth beyond this machine, by a
timing model of one expert-parallel decode step (DeepSeek-V3's shape by default: 58 MoE layers,
256 experts, top-8, hidden 7168, expert intermediate 2048, fp8 weights).

Per MoE layer, each rank's time is the weight reads of its slots that got tokens plus its
(token, expert) rows' matmul work; the layer costs its slowest rank (everyone waits at the
combine) plus a dispatch and a combine all-to-all. The step is the sum over layers. Loads are
Zipf over experts, shuffled per layer; the placement is computed from one sample of a window of
steps and judged on a fresh one (routing noise included). Policies:

- static: experts contiguous over ranks, the redundant slots on copies of the first experts;
- DeepSeek reference: replicate the hottest experts, greedy packing (refine_steps=0), even
  replica shares;
- ours: the same plus swap refinement and per-replica routing shares (balancer/eplb.py);
- ours, on time: the same policy fed each expert's modelled time per step instead of its token
  count: its rows' matmul work, which replicas split, plus its weight read in every step it has
  rows, which every replica pays whole (`rebalance_experts(..., fixed=reads)`);
- on time, reads split: the same time fed as one weight, as if replicas split reads too.

`--trace FILE` replaces Zipf with the expert load a live `evenflow bench ep --record-trace FILE`
saw: each recorded layer's rank-frequency curve (expert shares, sorted) is stretched to the
simulated expert count, and the simulated layers cycle over the recorded ones.

The hardware figures are assumptions (H100-class, printed with the table), not measurements.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from evenflow.balancer.eplb import rebalance_experts, replica_shares


@dataclass(frozen=True)
class Hardware:
    weight_gbps: float = 3000.0  # HBM read bandwidth per rank
    tflops: float = 600.0  # sustained matmul throughput per rank (fp8)
    a2a_gbps: float = 40.0  # all-to-all bandwidth per rank (IB/NVLink mix)
    a2a_latency_us: float = 25.0  # per all-to-all


@dataclass(frozen=True)
class Shape:
    layers: int = 58
    experts: int = 256
    top_k: int = 8
    hidden: int = 7168
    intermediate: int = 2048
    weight_bytes: float = 1.0  # fp8
    tokens_per_rank: int = 128  # decode batch per DEP rank


def static_phy2log(experts: int, slots: int, layers: int) -> torch.Tensor:
    return (torch.arange(slots) % experts).repeat(layers, 1)


def sample_rows(probs: torch.Tensor, pairs: int, g: torch.Generator) -> torch.Tensor:
    """(layers, experts) (token, expert) rows per expert for one step."""
    return torch.stack([torch.bincount(torch.multinomial(p, pairs, True, generator=g),
                                       minlength=p.shape[0]) for p in probs]).float()


def load_trace(path: str) -> torch.Tensor:
    """(layers, experts) token counts recorded by `bench ep --record-trace`."""
    return torch.tensor(json.loads(Path(path).read_text())["load"], dtype=torch.float64)


def stretched(trace: torch.Tensor, experts: int, layers: int, g: torch.Generator
              ) -> torch.Tensor:
    """(layers, experts) routing probabilities with the trace's per-layer skew."""
    rows = []
    for i in range(layers):
        curve = torch.sort(trace[i % trace.shape[0]], descending=True).values
        curve = curve / curve.sum()
        at = torch.linspace(0, len(curve) - 1, experts, dtype=torch.float64)
        low = at.floor().long()
        high = (low + 1).clamp_max(len(curve) - 1)
        values = curve[low] + (curve[high] - curve[low]) * (at - low)
        rows.append(values[torch.randperm(experts, generator=g)])
    probs = torch.stack(rows)
    return (probs / probs.sum(1, keepdim=True)).float()


def modelled_time(samples: list[torch.Tensor], shape: Shape, hw: Hardware
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(layers, experts) seconds per step of each expert: its rows' matmul work (split among
    replicas), and its weight read in the steps it had rows (paid by every replica)."""
    expert_bytes = 3 * shape.hidden * shape.intermediate * shape.weight_bytes
    stacked = torch.stack(samples)
    active = (stacked > 0).float().mean(0)
    rows = stacked.mean(0)
    return (rows * 2 * 3 * shape.hidden * shape.intermediate / (hw.tflops * 1e12),
            active * expert_bytes / (hw.weight_gbps * 1e9))


def step_time_ms(rows: torch.Tensor, phy2log: torch.Tensor, share: torch.Tensor | None,
                 ranks: int, shape: Shape, hw: Hardware) -> tuple[float, float]:
    """(step ms, straggler share: (max - mean) / max rank MoE time, averaged over layers)."""
    L, slots = phy2log.shape
    if share is None:
        counts = torch.zeros(L, rows.shape[1]).scatter_add_(1, phy2log, torch.ones(L, slots))
        share = 1.0 / counts.gather(1, phy2log)
    slot_rows = rows.gather(1, phy2log) * share  # (L, slots)
    expert_bytes = 3 * shape.hidden * shape.intermediate * shape.weight_bytes
    read_s = (slot_rows > 0.5).float() * expert_bytes / (hw.weight_gbps * 1e9)
    flops_s = slot_rows * 2 * 3 * shape.hidden * shape.intermediate / (hw.tflops * 1e12)
    per_rank = (read_s + flops_s).view(L, ranks, -1).sum(-1)  # (L, ranks)
    slowest = per_rank.max(1).values
    a2a_bytes = shape.tokens_per_rank * shape.top_k * shape.hidden * 1.0  # fp8 dispatch
    a2a_s = 2 * (hw.a2a_latency_us * 1e-6 + a2a_bytes / (hw.a2a_gbps * 1e9))
    straggler = float(((slowest - per_rank.mean(1)) / slowest).mean())
    return float((slowest + a2a_s).sum()) * 1e3, straggler


def simulate(ranks_list: list[int], shape: Shape, zipf_s: float = 1.0,
             redundant_per_rank: int = 1, window_steps: int = 32, seed: int = 0,
             hw: Hardware | None = None, trace: torch.Tensor | None = None) -> list[str]:
    hw = hw or Hardware()
    g = torch.Generator().manual_seed(seed)
    if trace is not None:
        probs = stretched(trace, shape.experts, shape.layers, g)
        source = f"load traced live ({trace.shape[0]} layers x {trace.shape[1]} experts)"
    else:
        base = 1.0 / torch.arange(1, shape.experts + 1).double() ** zipf_s
        probs = torch.stack([base[torch.randperm(shape.experts, generator=g)]
                             for _ in range(shape.layers)])
        probs = (probs / probs.sum(1, keepdim=True)).float()
        source = f"Zipf s={zipf_s}"
    lines = [f"timing model: {shape.layers} MoE layers x {shape.experts} experts, top-"
             f"{shape.top_k}, hidden {shape.hidden}, expert intermediate {shape.intermediate}, "
             f"{shape.tokens_per_rank} decode tokens per rank, {source}; assumed "
             f"{hw.weight_gbps:.0f} GB/s weights, {hw.tflops:.0f} TFLOP/s, all-to-all "
             f"{hw.a2a_gbps:.0f} GB/s + {hw.a2a_latency_us:.0f} us",
             f"  {'ranks':>5} {'policy':22} {'step ms':>8} {'straggler %':>12} "
             f"{'vs static':>10}"]
    for ranks in ranks_list:
        if shape.experts % ranks:
            continue
        slots = shape.experts + redundant_per_rank * ranks
        pairs = shape.tokens_per_rank * ranks * shape.top_k
        samples = [sample_rows(probs, pairs, g) for _ in range(window_steps)]
        window = torch.stack(samples).sum(0)
        judged = [sample_rows(probs, pairs, g) for _ in range(4)]
        reference = rebalance_experts(window, slots, 1, 1, ranks, refine_steps=0).phy2log
        ours = rebalance_experts(window, slots, 1, 1, ranks).phy2log
        work, reads = modelled_time(samples, shape, hw)
        on_time = rebalance_experts(work, slots, 1, 1, ranks, fixed=reads).phy2log
        naive = rebalance_experts(work + reads, slots, 1, 1, ranks).phy2log
        policies = [("static", static_phy2log(shape.experts, slots, shape.layers), None),
                    ("DeepSeek reference", reference, None),
                    ("ours (+ shares)", ours, replica_shares(window, ours, ranks)),
                    ("ours, on time", on_time, replica_shares(window, on_time, ranks)),
                    ("on time, reads split", naive, replica_shares(window, naive, ranks))]
        static_ms = None
        for name, phy2log, share in policies:
            results = [step_time_ms(rows, phy2log, share, ranks, shape, hw) for rows in judged]
            ms = sum(r[0] for r in results) / len(results)
            straggler = sum(r[1] for r in results) / len(results)
            static_ms = static_ms or ms
            lines.append(f"  {ranks:5d} {name:22} {ms:8.2f} {100 * straggler:12.1f} "
                         f"{static_ms / ms:9.2f}x")
    return lines
