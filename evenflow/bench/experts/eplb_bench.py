"""`evenflow bench eplb`: expert placement quality and speed on synthetic loads.

1. Zipf loads (s = 0.5, 1.0, 1.5): 58 layers x 256 experts -> 288 slots on 32 GPUs in 4 nodes
   (hierarchical, 8 groups), -> 320 slots on 64 GPUs (global), and 16 x 64 -> 80 slots on 8
   GPUs: balancedness (mean / max rank load) of a static contiguous placement, of ours, and of
   ours with per-replica routing shares; compute time.
2. A drifting load: fixed-interval rebalancing vs the threshold trigger on a sliding window -
   mean balancedness over the run and how many rebalances each needed.
3. Slots moved per rebalance, from scratch vs migration-aware, and the balancedness each reaches.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from evenflow.balancer.eplb import (
    balancedness,
    rebalance_experts,
    rebalance_from,
    replica_shares,
    slots_moved,
    static_placement,
)
from evenflow.balancer.policy import LoadWindow, ThresholdTrigger, TriggerConfig

CASES = [  # layers, experts, slots, groups, nodes, gpus, label
    (58, 256, 288, 8, 4, 32, "58x256 -> 288 / 32 GPUs, 4 nodes (hierarchical)"),
    (58, 256, 320, 1, 1, 64, "58x256 -> 320 / 64 GPUs (global)"),
    (16, 64, 80, 1, 1, 8, "16x64 -> 80 / 8 GPUs (global)"),
]


def zipf_load(layers: int, experts: int, s: float, seed: int = 0,
              tokens: float = 1e6) -> torch.Tensor:
    """Per layer, expert loads proportional to 1 / rank^s, ranks shuffled per layer."""
    g = torch.Generator().manual_seed(seed)
    base = 1.0 / torch.arange(1, experts + 1).double() ** s
    w = torch.stack([base[torch.randperm(experts, generator=g)] for _ in range(layers)])
    return (w / w.sum(1, keepdim=True) * tokens).float()


def placement_table(reps: int) -> list[str]:
    lines = [f"{'case':50} {'s':>4} {'static':>7} {'ours':>7} {'+shares':>8} {'time ms':>8}"]
    for layers, experts, slots, groups, nodes, gpus, label in CASES:
        for s in (0.5, 1.0, 1.5):
            w = zipf_load(layers, experts, s)
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                p = rebalance_experts(w, slots, groups, nodes, gpus)
                times.append(time.perf_counter() - t0)
            share = replica_shares(w, p.phy2log, gpus)
            lines.append(f"{label:50} {s:4.1f} "
                         f"{balancedness(w, static_placement(experts, gpus, layers), gpus):7.3f} "
                         f"{balancedness(w, p.phy2log, gpus):7.3f} "
                         f"{balancedness(w, p.phy2log, gpus, share):8.3f} "
                         f"{statistics.median(times) * 1e3:8.1f}")
    return lines


def drift(layers: int, experts: int, steps: int, sigma: float, seed: int) -> list[torch.Tensor]:
    """Per-step expected loads whose log-weights take a random walk (the hot experts change)."""
    g = torch.Generator().manual_seed(seed)
    logw = zipf_load(layers, experts, 1.0, seed).log()
    out = []
    for _ in range(steps):
        logw = logw + torch.randn(logw.shape, generator=g) * sigma
        w = logw.exp()
        out.append(w / w.sum(1, keepdim=True) * 8192)  # tokens x top-k per step
    return out


def drift_table(steps: int) -> list[str]:
    layers, experts, slots, gpus = 16, 64, 80, 8
    loads = drift(layers, experts, steps, 0.02, seed=3)
    g = torch.Generator().manual_seed(4)
    counts = [torch.poisson(w, generator=g) for w in loads]
    initial = rebalance_experts(counts[0], slots, 1, 1, gpus).phy2log

    def run(policy: str, interval: int = 0) -> tuple[float, int, float]:
        placement, window = initial.clone(), LoadWindow(200)
        trigger = ThresholdTrigger(TriggerConfig(threshold=0.9, min_interval=50, window=200),
                                   gpus)
        scores, rebalances, moved = [], 0, []
        for step, c in enumerate(counts):
            scores.append(balancedness(c, placement, gpus))
            window.add(c)
            due = (policy == "interval" and step % interval == interval - 1) or (
                policy == "threshold" and trigger.observe(c, placement))
            if due:
                new = rebalance_from(placement, trigger.window.load() if policy == "threshold"
                                     else window.load(), gpus)
                moved.append(slots_moved(placement, new.phy2log))
                placement, rebalances = new.phy2log, rebalances + 1
        return statistics.fmean(scores), rebalances, statistics.fmean(moved) if moved else 0.0

    lines = [f"drifting load, {steps} steps, {layers}x{experts} -> {slots} / {gpus} GPUs "
             f"(per-step balancedness of the placement in force):",
             f"  {'policy':28} {'mean balancedness':>18} {'rebalances':>11} {'slots moved':>12}"]
    never = statistics.fmean(balancedness(c, initial, gpus) for c in counts)
    lines.append(f"  {'never rebalance':28} {never:18.3f} {0:11d} {0:12.1f}")
    for label, policy, interval in (("every 500 steps", "interval", 500),
                                    ("every 100 steps", "interval", 100),
                                    ("threshold 0.90 (min 50)", "threshold", 0)):
        mean, n, moved = run(policy, interval)
        lines.append(f"  {label:28} {mean:18.3f} {n:11d} {moved:12.1f}")
    return lines


def migration_table() -> list[str]:
    layers, experts, slots, gpus = 58, 256, 320, 64
    w0 = zipf_load(layers, experts, 1.0, seed=0)
    current = rebalance_experts(w0, slots, 1, 1, gpus).phy2log
    lines = [f"slots moved per rebalance, {layers}x{experts} -> {slots} / {gpus} GPUs, after a "
             "drift (log-normal, sigma as given):",
             f"  {'sigma':>5} {'stale':>7} {'fresh':>7} {'moved':>7} {'aware':>7} {'moved':>7} "
             f"{'ratio':>6}"]
    for i, sigma in enumerate((0.1, 0.3, 0.6)):
        g = torch.Generator().manual_seed(10 + i)
        w1 = w0 * torch.exp(torch.randn(w0.shape, generator=g) * sigma)
        fresh = rebalance_experts(w1, slots, 1, 1, gpus).phy2log
        aware = rebalance_from(current, w1, gpus, tolerance=0.01).phy2log
        mf, ma = slots_moved(current, fresh), slots_moved(current, aware)
        lines.append(f"  {sigma:5.1f} {balancedness(w1, current, gpus):7.3f} "
                     f"{balancedness(w1, fresh, gpus):7.3f} {mf:7d} "
                     f"{balancedness(w1, aware, gpus):7.3f} {ma:7d} {ma / mf:6.2f}")
    return lines


def live(seconds: float) -> int:
    """A skewed workload (counting prompts) through a local mesh whose workers run 4 virtual EP
    ranks with 4 redundant slots; the balancer pushes placements as it sees fit."""
    import asyncio
    import threading

    import httpx
    import nats

    from evenflow.engine.model.placement import rank_balancedness
    from evenflow.proto import subjects
    from evenflow.proto.messages import ExpertLoad, ExpertPlacement, decode
    from evenflow.services.config import MeshConfig
    from evenflow.services.launcher import LocalMesh

    config = MeshConfig(port=0, num_prefill=1, num_decode=1, num_ep_ranks=4,
                        num_redundant_experts=4, eplb_report_interval_s=0.5,
                        eplb_window_reports=8, eplb_min_interval_reports=6, eplb_threshold=0.85)
    mesh = LocalMesh(config)
    mesh.start(health_timeout_s=180)
    loads: list[ExpertLoad] = []
    placements: list[tuple[float, ExpertPlacement]] = []
    stop = threading.Event()

    async def listen() -> None:
        nc = await nats.connect(mesh.admin_nats_url or mesh.config.nats_url or "")

        async def on_load(msg) -> None:
            m = decode(msg.data)
            if isinstance(m, ExpertLoad) and m.worker_id == "d0" and any(m.counts):
                loads.append(m)

        async def on_placement(msg) -> None:
            m = decode(msg.data)
            if isinstance(m, ExpertPlacement) and all(m.version != p.version
                                                      for _, p in placements):
                placements.append((time.monotonic(), m))

        await nc.subscribe(subjects.EXPERT_LOAD, cb=on_load)
        await nc.subscribe(subjects.EXPERT_PLACEMENT, cb=on_placement)
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await nc.close()

    listener = threading.Thread(target=lambda: asyncio.run(listen()), daemon=True)
    listener.start()
    prompts = [f"count from {n} :" for n in range(10, 400, 37)]

    def complete(prompt: str) -> str:
        return httpx.post(mesh.url + "/v1/completions", timeout=60, json={
            "model": "tiny-moe", "prompt": prompt, "max_tokens": 24,
            "temperature": 0}).json()["choices"][0]["text"]

    try:
        first = [complete(p) for p in prompts]
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for p in prompts:
                complete(p)
        time.sleep(1.0)
        last = [complete(p) for p in prompts]
        time.sleep(1.0)
    finally:
        stop.set()
        listener.join(5)
        mesh.stop()

    def score(version: int) -> tuple[float, int]:
        ms = [m for m in loads if m.version == version]
        if not ms:
            return float("nan"), 0
        shape = (ms[0].num_layers, ms[0].num_slots)
        total = torch.stack([torch.tensor(m.counts).view(shape) for m in ms]).sum(0)
        return rank_balancedness(total, 4), len(ms)

    print(f"live, tiny-moe, 4 virtual EP ranks x 3 slots (8 experts + 4 redundant), "
          f"{seconds:.0f} s of counting prompts through the mesh:")
    versions = sorted({m.version for m in loads})
    print(f"  {'placement version':>18} {'decode rank balancedness':>25} {'load reports':>13}")
    for v in versions:
        b, n = score(v)
        print(f"  {v:18d} {b:25.3f} {n:13d}")
    print(f"  placements pushed: {len(placements)}; greedy outputs identical before and after: "
          f"{first == last}")
    return 0 if first == last else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evenflow bench eplb", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000, help="steps of the drifting load")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--live", action="store_true",
                    help="on a local mesh with the default model: rank balancedness of the "
                    "decode worker before and after the balancer's push")
    ap.add_argument("--seconds", type=float, default=20.0, help="--live: workload duration")
    args = ap.parse_args(argv)
    if args.live:
        return live(args.seconds)
    torch.set_num_threads(1)
    print("\n".join(placement_table(args.reps)))
    print()
    print("\n".join(drift_table(args.steps)))
    print()
    print("\n".join(migration_table()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
