"""`evenflow bench ep`: does the balancer's placement remove a measured straggler between real
expert-parallel ranks?

On a skewed workload (tiny-moe's own routing, and a random 110M Mixtral whose router favours
experts 2 and 3, which the initial placement puts on one rank without replicas; or, with
`--arch deepseek_v3`, a random 110M DeepSeek-V3 of 64 fine-grained experts whose router favours
experts 2-7, all on rank 0 at first), N=2 DEP ranks
of 1 thread each (offline, engine/dep/offline.py) run batch-32 decode and a 2,048-token prefill
per rank, first under the initial placement (experts in order, the redundant slots on copies of
the first experts), then under the placement the balancer computes
from the load it saw (balancer/eplb.py: replicate hot experts, pack ranks evenly, replica
shares). Printed per phase: step time p50/p99, each rank's MoE compute and collective time per
step (the collective time includes waiting for the slowest rank), balancedness (mean/max over
ranks) in rows and in time, decode throughput, prefill step time, and the pause to apply the
placement; plus one process with 2 threads and no EP, for reference. All in one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from evenflow.bench.machine import bench_checkpoints, run_worker
from evenflow.bench.stepping import drive, random_prompts

FULL = dict(batch=32, prompt=128, output=64, prefill=2048, ranks=2)
QUICK = dict(batch=8, prompt=16, output=8, prefill=64, ranks=2)
REDUNDANT = 2  # slots beyond the experts, for replicas of hot experts


def _phase(engine, plan: dict, vocab: int, ids, seed: int) -> dict:
    """Decode at the plan's batch, then one prefill of plan['prefill'] tokens per rank (new
    prompts each phase: nothing comes from the prefix cache)."""
    drive(engine, random_prompts(plan["ranks"], 16, vocab, seed + 5), 4, ids)  # warm-up
    engine.moe_times.clear()
    steps = drive(engine, random_prompts(plan["batch"], plan["prompt"], vocab, seed + 1),
                   plan["output"], ids)
    decode = steps[2:]  # past the prefill steps
    moe = list(engine.moe_times)[2:]
    prefill = drive(engine, random_prompts(plan["ranks"], plan["prefill"], vocab, seed + 2), 1, ids)

    def per_rank(index: int) -> list[float]:
        return [statistics.median(step[r][index] for step in moe) * 1e3
                for r in range(plan["ranks"])]

    def balance(index: int) -> float:
        return statistics.fmean(statistics.fmean(s[index] for s in step)
                                / max(max(s[index] for s in step), 1e-12) for step in moe)

    return {"step_p50": statistics.median(decode) * 1e3,
            "step_p99": sorted(decode)[int(0.99 * (len(decode) - 1))] * 1e3,
            "compute": per_rank(0), "wait": per_rank(1), "rows": per_rank(2),
            "balance_rows": balance(2), "balance_time": balance(0),
            "tok_s": plan["batch"] * plan["output"] / sum(steps),
            "prefill_ms": max(prefill) * 1e3}


def run_ep(ckpt: str, plan: dict) -> dict:
    import torch

    from evenflow.balancer.eplb import rebalance_experts, replica_shares
    from evenflow.engine.dep.offline import DEPEngine
    from evenflow.engine.serving.engine import EngineConfig

    engine = DEPEngine(EngineConfig(model=ckpt, num_threads=1, expert_parallel_size=plan["ranks"],
                                    num_redundant_experts=REDUNDANT, max_num_seqs=64))
    vocab = engine.model_config.vocab_size
    ids = iter(range(10**9))
    try:
        initial = _phase(engine, plan, vocab, ids, 100)
        slots = engine.take_slot_counts()  # (layers, slots) tokens per physical slot
        placed = engine.engine.model.moe_layers()[0].placement
        assert placed is not None
        phy2log = placed.phy2log
        E = engine.model_config.num_experts
        load = torch.zeros(slots.shape[0], E).index_add_(1, phy2log, slots.float())
        placement = rebalance_experts(load, slots.shape[1], 1, 1, plan["ranks"])
        shares = replica_shares(load, placement.phy2log, plan["ranks"])
        engine.apply_placement(placement.phy2log, shares, version=1)
        balanced = _phase(engine, plan, vocab, ids, 200)
        moves = dataclasses.replace(engine.engine.placement.moves)
        moes = engine.engine.model.moe_layers()
        held = sum(m.resident_bytes() for m in moes)
        every = sum(m.resident_bytes() / len(m.resident or [0]) * m.num_experts for m in moes)
        # The same window balanced on modelled time instead: each expert costs its rows plus,
        # in every step it is active, one weight read (in rows' worth, measured here)
        read_rows = weight_read_in_rows(moes[0], engine.model_config.hidden_size,
                                        engine.engine.kv_dtype)
        rows, reads = time_weight(load, plan["batch"] * engine.model_config.num_experts_per_tok,
                                  read_rows)
        placement = rebalance_experts(rows, slots.shape[1], 1, 1, plan["ranks"], fixed=reads)
        engine.apply_placement(placement.phy2log,
                               replica_shares(load, placement.phy2log, plan["ranks"]),
                               version=2)
        timed = _phase(engine, plan, vocab, ids, 300)
    finally:
        engine.close()
    return {"initial": initial, "balanced": balanced, "time-balanced": timed,
            "read_rows": read_rows, "trace": load.tolist(),
            "pause_ms": engine.max_placement_pause_s * 1e3, "layers": moves.layers,
            "experts_read": moves.experts_read, "move_ms": moves.total_s * 1e3,
            "held_mb": held / 2**20, "every_mb": every / 2**20}


def weight_read_in_rows(moe, hidden: int, dtype) -> float:
    """How many token rows through an expert cost as much as reading its weights once: the
    1-row time over the per-row slope (rows 1 and 17), on this machine."""
    import torch

    gate_up, down = moe.experts_in_use().linears()

    def run(rows: int) -> float:
        x = torch.randn(rows, hidden).to(dtype)
        best = float("inf")
        for _ in range(20):
            t0 = time.perf_counter()
            g, u = gate_up(x, 0).chunk(2, dim=-1)
            down(g * u, 0)
            best = min(best, time.perf_counter() - t0)
        return best

    one, many = run(1), run(17)
    return one / max((many - one) / 16, 1e-9)


def time_weight(load, pairs_per_step: int, read_rows: float):
    """Per (layer, expert) and step, in rows' worth of time: its expected rows (replicas split
    them), and read_rows times the chance that any of the step's pairs picks it (its weight
    read, which every replica pays whole)."""
    share = load / load.sum(1, keepdim=True).clamp_min(1e-9)
    active = 1 - (1 - share) ** pairs_per_step
    return share * pairs_per_step, read_rows * active


def run_single(ckpt: str, plan: dict) -> dict:
    from evenflow.engine.serving.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=ckpt, num_threads=2, max_num_seqs=64,
                                 max_num_batched_tokens=plan["ranks"] * plan["prefill"]))
    vocab = engine.model_config.vocab_size
    ids = iter(range(10**9))
    drive(engine, random_prompts(2, 16, vocab, 5), 4, ids)
    steps = drive(engine, random_prompts(plan["batch"], plan["prompt"], vocab, 1), plan["output"],
                   ids)
    prefill = drive(engine, random_prompts(plan["ranks"], plan["prefill"], vocab, 2), 1, ids)
    return {"step_p50": statistics.median(steps[1:]) * 1e3,
            "step_p99": sorted(steps[1:])[int(0.99 * (len(steps) - 2))] * 1e3,
            "tok_s": plan["batch"] * plan["output"] / sum(steps), "prefill_ms": max(prefill) * 1e3}


def skewed_mixtral(root: Path) -> Path:
    """The bench's random 110M Mixtral with the router rows of experts 2 and 3 scaled up 6x:
    their logits vary 6x as much, so top-2 picks them far more often. Both start on rank 0 and
    without a replica (the initial placement's redundant slots copy experts 0 and 1)."""
    from safetensors.torch import load_file, save_file

    from evenflow.bench.checkpoint import write_random_mixtral

    base = write_random_mixtral(root / "mixtral-110m")
    out = root / "mixtral-110m-skewed-2-3"
    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(base / "model.safetensors"))
    for name, t in tensors.items():
        if name.endswith("block_sparse_moe.gate.weight"):
            t[2:4] *= 6
    for f in base.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def _worker(argv: list[str]) -> int:
    kind, ckpt, plan = argv[0], argv[1], json.loads(argv[2])
    print(json.dumps(run_ep(ckpt, plan) if kind == "ep" else run_single(ckpt, plan)))
    return 0


def _table(name: str, ep: dict, single: dict | None) -> str:
    ranks = len(ep["initial"]["compute"])
    lines = [f"{name}: {ranks} DEP ranks x 1 thread"
             f"{'' if single is None else ', and 1 process x 2 threads without EP'}",
             f"  {'placement':12} {'step p50':>9} {'p99':>7} {'MoE ms/rank':>16} "
             f"{'collect. ms/rank':>17} {'bal. rows':>9} {'bal. time':>9} {'tok/s':>8} "
             f"{'prefill ms':>10}"]
    for phase in ("initial", "balanced", "time-balanced"):
        r = ep[phase]
        lines.append(
            f"  {phase:12} {r['step_p50']:9.2f} {r['step_p99']:7.2f} "
            f"{' / '.join(f'{v:.2f}' for v in r['compute']):>16} "
            f"{' / '.join(f'{v:.2f}' for v in r['wait']):>17} {r['balance_rows']:9.3f} "
            f"{r['balance_time']:9.3f} {r['tok_s']:8.1f} {r['prefill_ms']:10.1f}")
    if single is not None:
        lines.append(f"  {'1 proc, 2 thr':12} {single['step_p50']:9.2f} {single['step_p99']:7.2f}"
                     f" {'-':>16} {'-':>17} {'-':>9} {'-':>9} {single['tok_s']:8.1f} "
                     f"{single['prefill_ms']:10.1f}")
    a, b, t = ep["initial"], ep["balanced"], ep["time-balanced"]
    lines.append(f"  balanced vs initial: decode step {b['step_p50'] / a['step_p50']:.2f}x the "
                 f"time, prefill {b['prefill_ms'] / a['prefill_ms']:.2f}x; balanced on time "
                 f"(a weight read = {ep['read_rows']:.0f} rows here) vs initial: decode "
                 f"{t['step_p50'] / a['step_p50']:.2f}x, prefill "
                 f"{t['prefill_ms'] / a['prefill_ms']:.2f}x")
    lines.append(f"  placement change: {ep['layers']} MoE layers switched one per step, rank 0 "
                 f"read {ep['experts_read']} experts from the checkpoint in {ep['move_ms']:.1f} "
                 f"ms; largest pause before a step (any rank) {ep['pause_ms']:.1f} ms (a decode "
                 f"step: {a['step_p50']:.1f} ms)")
    lines.append(f"  expert weights held by rank 0: {ep['held_mb']:.1f} MB of {ep['every_mb']:.1f}"
                 f" MB (every expert)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    ap = argparse.ArgumentParser(prog="evenflow bench ep", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny-moe only, small sizes")
    ap.add_argument("--arch", default="mixtral", choices=["mixtral", "deepseek_v3"],
                    help="deepseek_v3: a random 110M DeepSeek-V3 (64 fine-grained experts "
                         "top-6, 1 shared) whose router favours experts 2-7, instead of "
                         "tiny-moe and the skewed Mixtral")
    ap.add_argument("--simulate", action="store_true",
                    help="the timing model of an EP step at scale instead "
                         "(bench/experts/ep_sim.py)")
    ap.add_argument("--ranks", default="8,32,64", help="--simulate: EP rank counts")
    ap.add_argument("--experts", type=int, default=256, help="--simulate: experts per layer")
    ap.add_argument("--layers", type=int, default=58, help="--simulate: MoE layers")
    ap.add_argument("--zipf", type=float, default=1.0, help="--simulate: Zipf exponent")
    ap.add_argument("--tokens-per-rank", type=int, default=128,
                    help="--simulate: decode tokens per rank and step")
    ap.add_argument("--trace", default=None,
                    help="--simulate: expert load recorded by a live run (--record-trace), "
                    "instead of Zipf")
    ap.add_argument("--record-trace", default=None, metavar="PATH",
                    help="write the skewed 110M model's expert load (JSON) for --simulate")
    args = ap.parse_args(argv)
    if args.simulate:
        from evenflow.bench.experts.ep_sim import Shape, load_trace, simulate

        shape = Shape(layers=args.layers, experts=args.experts,
                      tokens_per_rank=args.tokens_per_rank)
        trace = load_trace(args.trace) if args.trace else None
        print("\n".join(simulate([int(r) for r in args.ranks.split(",")], shape, args.zipf,
                                 trace=trace)))
        return 0

    from evenflow.bench.machine import machine_line
    from evenflow.engine.config.settings import cpu_has_bf16
    from evenflow.progress import Progress, on_terminal

    plan = QUICK if args.quick else FULL
    print(machine_line("bfloat16" if cpu_has_bf16() else "float32", 2))
    root = bench_checkpoints()
    models = [("tiny-moe", "tiny-moe")]
    if args.arch == "deepseek_v3":
        from evenflow.bench.checkpoint import write_family

        # experts 2-7 sit on rank 0 under the initial placement, all in routing group 0
        models = [("random 110M DeepSeek-V3, router skewed to experts 2-7", str(write_family(
            root / f"deepseek_v3-{'quick' if args.quick else '110m'}-skewed-2-7",
            "deepseek_v3", args.quick, skew=(2, 3, 4, 5, 6, 7))))]
    elif not args.quick:
        models.append(("random 110M Mixtral, router skewed to experts 2 and 3",
                       str(skewed_mixtral(root))))
    tables = []
    with Progress("bench ep: runs done", 2 * len(models), on_terminal()) as progress:
        for name, ckpt in models:
            model_plan = (dict(plan, prefill=min(plan["prefill"], 448)) if ckpt == "tiny-moe"
                          else plan)
            ep = run_worker("evenflow.bench.experts.ep_bench",
                            ["ep", ckpt, json.dumps(model_plan)], 1, name)
            progress.update()
            single = run_worker("evenflow.bench.experts.ep_bench",
                                ["single", ckpt, json.dumps(model_plan)], 2, name)
            progress.update()
            if ep is None:
                return 1
            tables.append((name, ckpt, ep, single))
    for name, ckpt, ep, single in tables:
        print(_table(name, ep, single))
        if args.record_trace and ckpt != "tiny-moe":
            Path(args.record_trace).write_text(json.dumps({"model": name, "load": ep["trace"]}))
            print(f"  expert load written to {args.record_trace} (bench ep --simulate --trace)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
