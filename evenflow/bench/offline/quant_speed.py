"""The speed half of `evenflow bench quant`: engines alternating in one process, round by round
(a shared host drifts between processes by more than quantization changes a step), their
decode and prefill times, and each quantized weight's kernel plan; `--compact`'s forms as
checkpoints ship them, against their family's bf16."""

from __future__ import annotations

import os
import random
import statistics
from pathlib import Path
from typing import Any
from unittest import mock


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


# --compact: the forms checkpoints ship in, each family's against its own bf16 checkpoint (the
# files `bench load` writes: bench/offline/load_bench.py), alternating in one process per family
COMPACT = {"mixtral": ("bf16", ("gguf-q8_0", "gguf-q5_k_m", "gguf-q4_k_m")),
           "gpt_oss": ("gpt_oss", ("mxfp4",)), "deepseek_v3": ("deepseek_v3", ("fp8",))}


def run_compact(family: str, ckpt: str, threads: int, plan: dict) -> dict:
    """One family's bf16 checkpoint and its compact forms, alternating (run_alternating); the
    checkpoints beside `ckpt` (the bench's)."""
    from evenflow.bench.offline.load_bench import checkpoints

    paths = checkpoints(Path(ckpt).parent, bool(plan.get("quick")))
    base, forms = COMPACT[family]
    return run_alternating({name: (str(paths[name][0]), {}, {}) for name in (base, *forms)},
                           threads, plan)


def run_alternating(specs: dict[str, tuple[str, dict[str, Any], dict[str, str]]], threads: int,
                    plan: dict) -> dict:
    """Decode ms/step per batch and prefill ms of these engines (name -> (model, engine
    arguments, environment while it loads)) in this one process, in alternating rounds: every
    round's figure (ms), the step's bytes and the kernel plans."""
    from evenflow.bench.stepping import drive
    from evenflow.engine.serving.engine import Engine, EngineConfig

    engines = {}
    for v, (model, extra, env) in specs.items():  # (a variant's switches hold while packing)
        with mock.patch.dict(os.environ, env):
            engines[v] = Engine(EngineConfig(model=model, num_threads=threads, max_num_seqs=64,
                                             max_num_batched_tokens=4096, num_kv_blocks=2048,
                                             **extra))
    vocab = min(e.model_config.vocab_size for e in engines.values())
    ids = iter(range(10**9))

    def steps(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[float]:
        return drive(engine, prompts, max_tokens, ids)

    for engine in engines.values():
        steps(engine, random_prompts(2, 32, vocab, 99), 4)  # warm-up
    rounds = plan["rounds"]
    decode: dict[str, dict[int, list[float]]] = {v: {} for v in engines}
    for b in plan["batches"]:
        for r in range(rounds):
            for v, engine in engines.items():
                times = steps(engine, random_prompts(b, plan["prompt"], vocab, 50 * b + r),
                              plan["output"])
                decode[v].setdefault(b, []).append(statistics.median(times[1:]))
    prefill: dict[str, dict[int, list[float]]] = {v: {} for v in engines}
    for size in plan["prefill"]:
        for r in range(rounds):
            for v, engine in engines.items():
                prefill[v].setdefault(size, []).append(sum(steps(
                    engine, random_prompts(1, size, vocab, 700 + 10 * size + r), 1)))
    from evenflow.bench.bandwidth import step_bytes

    context = plan["prompt"] + plan["output"] // 2  # a batch-1 step's mean context
    return {v: {"decode_ms": {b: [x * 1e3 for x in t] for b, t in decode[v].items()},
                "prefill_ms": {n: [x * 1e3 for x in t] for n, t in prefill[v].items()},
                "step_bytes": step_bytes(engines[v], context),
                "kernel_plans": kernel_plans(engines[v])} for v in engines}


def kernel_plans(engine: Any) -> list[list]:
    """The quantized panels' kernel plans in this engine, one per (form, shape): [form, N, K,
    dequant_from, the way at each probe row count]."""
    from evenflow.engine.kernels.plan import ROWS_DEQUANT
    from evenflow.engine.quant.panel_stack import PanelStack

    seen: dict[tuple, list] = {}
    for module in engine.model.modules():
        stacks = [getattr(module, "weight_q", None)]
        stored = getattr(module, "stored", None)
        stacks += [getattr(stored, "gate_up", None), getattr(stored, "down", None)]
        for stack in stacks:
            if isinstance(stack, PanelStack):
                key = (stack.form, stack.out_features, stack.in_features)
                if key not in seen:
                    ways = stack.plan(engine.dtype)
                    seen[key] = [*key, stack.dequant_from,
                                 "".join("Q" if w == ROWS_DEQUANT else "D" for w in ways)]
    return sorted(seen.values())


def print_alternating(runs: dict[str, dict], plan: dict) -> None:
    """The speed table of one alternating run: the first engine is the baseline."""
    names = list(runs)
    width = max(12, *(len(v) + 2 for v in names))  # (names never run together)
    print(f"{'metric':30}" + "".join(f"{v:>{width}}" for v in names) + "   ratios: " +
          ", ".join(names[1:]))

    def row(name: str, figures: dict[str, list[float]]) -> None:
        first = figures[names[0]]
        ratios = []
        for v in names[1:]:
            each = [a / q for a, q in zip(first, figures[v], strict=True)]
            ratios.append(f"{statistics.median(each):.2f}x [{min(each):.2f}-{max(each):.2f}]")
        print(f"{name:30}" + "".join(f"{statistics.median(figures[v]):{width}.2f}" for v in names)
              + "   " + ", ".join(ratios))

    for b in plan["batches"]:
        row(f"decode batch {b} (ms/step)", {v: runs[v]["decode_ms"][str(b)] for v in names})
    for size in plan["prefill"]:
        row(f"prefill {size} tokens (ms)", {v: runs[v]["prefill_ms"][str(size)] for v in names})


def print_kernel_plans(plans: dict[str, list[list]]) -> None:
    """Each quantized panel's plan, as measured once on this machine (engine/kernels/plan.py)."""
    from evenflow.engine.kernels.plan import NEVER_DEQUANT, PANEL_PROBE_ROWS

    print("\nkernel plans, measured once on this machine (kept for every process on it): at "
          f"rows {', '.join(map(str, PANEL_PROBE_ROWS))}: D the codes read directly (int8 rows "
          "where the form takes them), Q the panel dequantized first for the dot product")
    print(f"{'variant':14}{'form':>12}{'N':>7}{'K':>7}  {'ways':12}dequantized from")
    for variant, rows in plans.items():
        for form, n, k, start, ways in rows:
            where = "never" if start >= NEVER_DEQUANT else f"{start} rows"
            print(f"{variant:14}{form:>12}{n:7d}{k:7d}  {ways:12}{where}")
