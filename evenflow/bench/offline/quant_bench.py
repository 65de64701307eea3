"""`evenflow bench quant`: int8, int4 (weight-only) and w8a8 (int8 weights and per-token int8
activations) against the unquantized model in the machine's native dtype, all in one run.

Speed, the headline: on the random Mixtral-style 110M checkpoint, the unquantized engine and
the int8, int4-g64, int4-g64-a16 (int4's kernel before W4A8: EVENFLOW_NATIVE_W4A8=0) and w8a8
engines in one process, their runs alternating batch size by batch
size (native, int8, int4, w8a8, native, ...; 5 rounds): decode ms/step at batch 1, 8 and 32
(128-token prompts) and prefill of 512 and 2,048 tokens, as medians; each ratio (unquantized time /
quantized time) is the median of the rounds' ratios, with their spread (min-max). On a shared
host the speed drifts between processes by more than quantization changes it; alternating puts
the same drift on each.

Memory and quality, each variant in its own process (same threads): the weights' bytes and the
peak RSS the model load adds; then two quality tables:
- the 110M model, 200 random prompts: greedy agreement with the unquantized model (share of
  prompts whose 64 greedy tokens all agree, mean first-divergence position, mean share of
  agreeing positions) and mean cosine of the first token's logits. On a random model agreement
  is judged against the model's own noise floor: the same model computed in float32 agrees
  with it only so far, and a quantized variant passes when its mean share of agreeing
  positions is at least float32's minus 5 points (the `vs fp32` column);
- tiny-moe's checkable tasks, 300 prompts each: exact-match accuracy of counting, counting down
  and reversing, unquantized vs each method (a method passes within 2 points).
int8 and int4 also run on torch's kernels alone (EVENFLOW_NATIVE_KERNELS=0, the `-torch`
variants: quality and memory).

`--vllm-python PATH`: W8A8 against vLLM's CPU build on the same compressed-tensors files
(bench/offline/quant_vllm.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from evenflow.bench.machine import peak_rss_mb, reset_peak_rss, run_worker
from evenflow.bench.offline.quant_speed import (
    COMPACT,
    print_alternating,
    print_kernel_plans,
    random_prompts,
    run_alternating,
    run_compact,
)

VARIANTS: dict[str, dict[str, Any]] = {
    "native": {}, "int8": {"quantization": "int8"},
    "int4-g64": {"quantization": "int4", "quant_group_size": 64},
    # int4 as it ran before the W4A8 kernel: the decode rows in bf16 / float32, not int8
    # (EVENFLOW_NATIVE_W4A8=0); the same as int4-g64 where the CPU has no VNNI
    "int4-g64-a16": {"quantization": "int4", "quant_group_size": 64},
    "w8a8": {"quantization": "w8a8"},
    # the noise floor of the quality table: the same unquantized model computed in float32
    "float32": {"dtype": "float32"},
    # the same quantized models on torch's kernels alone (without ours: engine/kernels/native.py)
    "int8-torch": {"quantization": "int8"},
    "int4-torch": {"quantization": "int4", "quant_group_size": 64}}
VARIANT_ENV = {"int4-g64-a16": {"EVENFLOW_NATIVE_W4A8": "0"},
               "int8-torch": {"EVENFLOW_NATIVE_KERNELS": "0"},
               "int4-torch": {"EVENFLOW_NATIVE_KERNELS": "0"}}
TASK_VARIANTS = ("native", "int8", "int4-g64", "w8a8", "float32")
FULL: dict[str, Any] = dict(batches=[1, 8, 32], prompt=128, output=64, prefill=[512, 2048],
                            rounds=5,
                            quality_prompts=200, quality_tokens=64, task_prompts=300)
QUICK: dict[str, Any] = dict(quick=True, batches=[1, 4], prompt=16, output=8, prefill=[64],
                             rounds=2,
                             quality_prompts=8, quality_tokens=8, task_prompts=10)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_speed_and_quality(ckpt: str, variant: str, threads: int, plan: dict) -> dict:
    import torch

    from evenflow.engine.serving.engine import Engine, EngineConfig
    from evenflow.engine.weights.loader import (
        load_model,
        model_directory,
        quant_config,
        torch_dtype,
    )
    from evenflow.engine.weights.quantize_model import quantized_bytes
    from evenflow.proto.sampling import SamplingParams

    config = EngineConfig(model=ckpt, num_threads=threads, max_num_seqs=64,
                          max_num_batched_tokens=4096, num_kv_blocks=2048, **VARIANTS[variant])
    # Warm up first on tiny-moe (the same code paths: safetensors, the kernels, the shape
    # measurements), so that what the big load adds is the model, not one-off process costs.
    load_model(model_directory("tiny-moe"), torch_dtype(config), quant_config(config))
    gc.collect()
    before = _rss_mb()
    reset_peak_rss()  # (the warm-up's peak is not this load's)
    load_model(model_directory(ckpt), torch_dtype(config), quant_config(config))  # alone, first
    load_peak_mb = peak_rss_mb() - before
    engine = Engine(config)
    weights_mb = quantized_bytes(engine.model) / 2**20
    vocab = engine.model_config.vocab_size
    ids = iter(range(10**9))

    def run(prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list[list[int]]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        order = []
        for p in prompts:
            order.append(str(next(ids)))
            engine.add_request(order[-1], p, params)
        steps: list[float] = []
        tokens: dict[str, list[int]] = {rid: [] for rid in order}
        while engine.has_unfinished():
            t0 = time.perf_counter()
            for out in engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
            steps.append(time.perf_counter() - t0)
        return steps, [tokens[rid] for rid in order]

    run(random_prompts(2, 32, vocab, 99), 4)  # warm-up
    result: dict = {"load_peak_mb": load_peak_mb, "weights_mb": weights_mb, "decode_ms": {}}
    run(random_prompts(1, plan["prefill"][0], vocab, 5), 1)
    result["prefill_ms"] = statistics.median(
        sum(run(random_prompts(1, plan["prefill"][0], vocab, 6 + r), 1)[0])
        for r in range(3)) * 1e3
    for b in plan["batches"]:
        steps, _ = run(random_prompts(b, plan["prompt"], vocab, b), plan["output"])
        result["decode_ms"][b] = statistics.median(steps[1:]) * 1e3
    prompts = random_prompts(plan["quality_prompts"], 32, vocab, 1234)
    _, result["greedy"] = run(prompts, plan["quality_tokens"])
    captured: list = []
    forward = engine.model.forward

    def capture(*args, **kwargs):
        logits = forward(*args, **kwargs)
        captured.append(logits[0].float())
        return logits

    engine.model.forward = capture  # type: ignore[method-assign]
    for p in prompts:
        run([p], 1)
    engine.model.forward = forward  # type: ignore[method-assign]
    torch.save(torch.stack(captured), os.environ["EVENFLOW_BENCH_LOGITS"])
    return result


INTERLEAVED = ("native", "int8", "int4-g64", "int4-g64-a16", "w8a8")


def run_interleaved(ckpt: str, threads: int, plan: dict) -> dict:
    """INTERLEAVED's engines on the checkpoint, alternating (run_alternating)."""
    return run_alternating({v: (ckpt, VARIANTS[v], VARIANT_ENV.get(v, {})) for v in INTERLEAVED},
                           threads, plan)




def run_tasks(variant: str, threads: int, plan: dict) -> dict:
    return task_accuracy(threads, plan, **VARIANTS[variant])


def task_accuracy(threads: int, plan: dict, model: str = "tiny-moe", **engine_args: Any
                  ) -> dict:
    """tiny-moe's checkable tasks (count, count down, reverse, copy, edit), plan["task_prompts"]
    each:
    exact-match accuracy % per task (`model`: tiny-moe in another form, a GGUF of it, say)."""
    from evenflow import LLM, SamplingParams

    llm = LLM(model, num_threads=threads, **engine_args)
    rng = random.Random(7)
    tasks: dict[str, list[tuple[str, list[str]]]] = {"count": [], "count down": [],
                                                      "reverse": [], "copy": [], "edit": []}
    for _ in range(plan["task_prompts"]):
        n = rng.randint(0, 480)
        tasks["count"].append((f"count from {n} :", [str(i) for i in range(n, n + 8)]))
        n = rng.randint(20, 499)
        tasks["count down"].append((f"count down from {n} :",
                                    [str(i) for i in range(n, n - 8, -1)]))
        letters = [rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))]
        tasks["reverse"].append((f"reverse : {' '.join(letters)} =", letters[::-1]))
        words = [rng.choice("abcdefghijklmnopqrstuvwxyz") if rng.random() < 0.6 else
                 str(rng.randint(0, 499)) for _ in range(rng.randint(5, 24))]
        tasks["copy"].append((f"copy : {' '.join(words)} =", words))
        old, new = rng.choice(words), str(rng.randint(0, 499))
        tasks["edit"].append((f"edit : {' '.join(words)} ; {old} -> {new} =",
                              [new if w == old else w for w in words]))
    accuracy = {}
    for name, items in tasks.items():
        outs = llm.generate([p for p, _ in items],
                            [SamplingParams(temperature=0, max_tokens=len(a)) for _, a in items])
        hits = sum(o.text.split()[: len(a)] == a for o, (_, a) in zip(outs, items, strict=True))
        accuracy[name] = 100.0 * hits / len(items)
    return accuracy


def _worker(argv: list[str]) -> int:
    kind, variant, threads, plan = argv[0], argv[1], int(argv[2]), json.loads(argv[4])
    if kind == "speed":
        print(json.dumps(run_speed_and_quality(argv[3], variant, threads, plan)))
    elif kind == "interleaved":
        print(json.dumps(run_interleaved(argv[3], threads, plan)))
    elif kind == "compact":
        print(json.dumps(run_compact(variant, argv[3], threads, plan)))
    else:
        print(json.dumps(run_tasks(variant, threads, plan)))
    return 0


def _spawn(kind: str, variant: str, ckpt: str, threads: int, plan: dict, logits: str
           ) -> dict | None:
    return run_worker("evenflow.bench.offline.quant_bench",
                      [kind, variant, str(threads), ckpt, json.dumps(plan)], threads,
                      f"{kind} {variant}",
                      {"EVENFLOW_BENCH_LOGITS": logits, **VARIANT_ENV.get(variant, {})})


def agreement(ref: list[list[int]], other: list[list[int]]) -> tuple[float, float, float]:
    """(% prompts identical, mean first-divergence position, mean % positions agreeing)."""
    same, first, share = 0, [], []
    for a, b in zip(ref, other, strict=True):
        diverge = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        same += diverge == len(a)
        first.append(diverge)
        share.append(sum(x == y for x, y in zip(a, b, strict=True)) / len(a))
    return 100.0 * same / len(ref), statistics.mean(first), 100.0 * statistics.mean(share)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    ap = argparse.ArgumentParser(prog="evenflow bench quant", description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a tiny model and sizes (smoke test)")
    ap.add_argument("--checkpoint-dir", default=None)
    ap.add_argument("--llamacpp", default=None, metavar="DIR",
                    help="a llama.cpp build: bf16 / int8 / int4 against BF16 / Q8_0 / Q4_0 on "
                         "the same weights, and both serving one Q4_K_M file, alternating "
                         "(bench/offline/llamacpp.py)")
    ap.add_argument("--vllm-python", default=None, metavar="PATH",
                    help="the Python of a venv with vLLM's CPU build: W8A8 against vLLM's on "
                         "the same compressed-tensors files (README: Benchmarks)")
    ap.add_argument("--speed-only", action="store_true",
                    help="the alternating speed table and the kernel plans alone")
    ap.add_argument("--compact", action="store_true",
                    help="also the forms checkpoints ship in (GGUF Q8_0 / Q5_K_M / Q4_K_M, "
                         "MXFP4, FP8 block-wise), each against its family's bf16, alternating")
    args = ap.parse_args(argv)

    import torch

    from evenflow.bench.checkpoint import benchmark_checkpoint
    from evenflow.progress import Progress, on_terminal

    plan = QUICK if args.quick else FULL
    ckpt, dtype = benchmark_checkpoint(args.quick, args.checkpoint_dir, args.threads)
    print(f"checkpoint: {ckpt} (random Mixtral-style MoE); activations in {dtype}")
    from evenflow.bench.bandwidth import stream_bandwidth

    bandwidth = stream_bandwidth(args.threads)
    if args.llamacpp:  # llama.cpp beside the variants, on the same weights (offline/llamacpp.py)
        from evenflow.bench.offline.llamacpp import compare as beside_llamacpp
        from evenflow.bench.offline.llamacpp import native_variant

        beside_llamacpp(Path(ckpt), args.llamacpp, args.threads, {
            **dict([native_variant(dtype)]), "int8": ({"quantization": "int8"}, "q8_0"),
            "int4-g32": ({"quantization": "int4", "quant_group_size": 32}, "q4_0"),
            "same file": ({"gguf": True}, "q4_k_m")},
            args.quick)
    results, logits = {}, {}
    tasks = {}
    with tempfile.TemporaryDirectory() as tmp, Progress(
            "bench quant: variants measured",
            1 if args.speed_only else len(VARIANTS) + len(TASK_VARIANTS) + 1,
            on_terminal()) as progress:
        for variant in [] if args.speed_only else VARIANTS:
            path = os.path.join(tmp, f"{variant}.pt")
            result = _spawn("speed", variant, ckpt, args.threads, plan, path)
            if result is None:
                return 1
            results[variant], logits[variant] = result, torch.load(path)
            progress.update()
        alternating = _spawn("interleaved", "native", ckpt, args.threads, plan, "")
        progress.update()
        compact = {family: _spawn("compact", family, ckpt, args.threads, plan, "")
                   for family in (COMPACT if args.compact else ())}
        for v in [] if args.speed_only else TASK_VARIANTS:
            tasks[v] = _spawn("tasks", v, ckpt, args.threads, plan, "")
            progress.update()
    if alternating is not None:
        print(f"\nspeed: {', '.join(INTERLEAVED)} in one process, runs alternating "
              f"({plan['rounds']} rounds; ms: medians; ratio = unquantized / quantized time, "
              "the median of the rounds' ratios [min-max])")
        print_alternating(alternating, plan)
        from evenflow.bench.bandwidth import print_limit

        print_limit(bandwidth, {v: (statistics.median(alternating[v]["decode_ms"]["1"]),
                                    *alternating[v]["step_bytes"]) for v in INTERLEAVED})
        print_kernel_plans({v: alternating[v]["kernel_plans"] for v in INTERLEAVED})
    for family, runs in compact.items():
        if runs is not None:
            print(f"\nspeed of the compact forms as shipped ({family}: `bench load`'s "
                  "checkpoints), alternating with the family's bf16 in one process")
            print_alternating(runs, plan)
            print_kernel_plans({v: r["kernel_plans"] for v, r in runs.items()
                                if r["kernel_plans"]})
    if args.speed_only:
        return 0
    base = results["native"]
    print(f"\nmemory, each variant in its own process ({dtype} activations; ratio = "
          "unquantized / quantized)")
    names = list(VARIANTS)
    width = max(12, *(len(v) + 2 for v in names))  # (names never run together)
    print(f"{'metric':34}" + "".join(f"{v:>{width}}" for v in names) + "   ratios: " +
          ", ".join(names[1:]))

    def row(name: str, values: list[float], ratio_of: float) -> None:
        cells = "".join(f"{v:{width}.2f}" for v in values)
        ratios = "   " + " ".join(f"{ratio_of / v:5.2f}x" for v in values[1:])
        print(f"{name:34}{cells}{ratios}")

    row("weights (MiB)", [results[v]["weights_mb"] for v in VARIANTS], base["weights_mb"])
    row("peak RSS added by the load (MiB)", [results[v]["load_peak_mb"] for v in VARIANTS],
        base["load_peak_mb"])
    print(f"\nquality on the 110M model: {plan['quality_prompts']} prompts, "
          f"{plan['quality_tokens']} greedy tokens, against the unquantized model in {dtype}; "
          "vs fp32: agree % minus float32's (pass: >= -5)")
    print(f"{'variant':12}{'identical %':>13}{'first div.':>12}{'agree %':>10}{'cosine':>10}"
          f"{'vs fp32':>10}")
    floor = agreement(base["greedy"], results["float32"]["greedy"])[2]
    for v in list(VARIANTS)[1:]:
        same, first, share = agreement(base["greedy"], results[v]["greedy"])
        cos = torch.nn.functional.cosine_similarity(logits["native"], logits[v], dim=-1).mean()
        verdict = "" if v == "float32" else \
            f"{share - floor:+7.1f} {'pass' if share - floor >= -5 else 'FAIL'}"
        print(f"{v:12}{same:13.1f}{first:12.1f}{share:10.1f}{cos.item():10.5f}  {verdict}")
    print(f"\ntiny-moe tasks: exact-match accuracy %, {plan['task_prompts']} prompts each "
          "(pass: within 2 points of the unquantized model)")
    print(f"{'task':12}" + "".join(f"{v:>12}" for v in TASK_VARIANTS))
    for task in ("count", "count down", "reverse", "copy", "edit"):
        cells = [tasks[v] for v in TASK_VARIANTS]
        print(f"{task:12}" + "".join(f"{c[task]:12.1f}" if c else f"{'failed':>12}"
                                     for c in cells))
    if args.vllm_python:
        from evenflow.bench.checkpoint import write_family
        from evenflow.bench.offline.quant_vllm import compare

        dense = write_family(Path(ckpt).parent / ("llama-quick" if args.quick else "llama-110m"),
                             "llama", args.quick)
        compare(args.vllm_python, {"random 110M Mixtral (MoE)": Path(ckpt),
                                   "random 110M Llama (dense)": dense}, args.threads,
                plan["batches"], plan["rounds"], dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
