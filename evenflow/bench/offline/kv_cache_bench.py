"""`evenflow bench engine --kv-cache-dtype int8`: the int8 KV cache against the model-dtype cache
on the random 110M checkpoint.

- Capacity: KV blocks each holds in the same kv_cache_gb.
- Speed: decode ms/step at batch 1 and 32 with long contexts (2,048 tokens by default): both
  engines in one process, their sequences prefilled first (untimed), then rounds alternating
  between the engines, a few steps each; a ratio is the median of the rounds' ratios
  (model-dtype time / int8 time: > 1 means int8 is faster), the spread printed.
- Quality: greedy agreement with the model-dtype cache over long prompts (share of agreeing
  positions), beside float32's agreement with it (the model's own noise floor: pass when int8's
  is at least float32's minus 5 points); tiny-moe's tasks (pass: within 1 point).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from evenflow.bench.machine import run_worker
from evenflow.bench.stepping import alternating_decode, decode_blocks, random_prompts

FULL: dict[str, Any] = dict(batches=[1, 32], context=2048, rounds=5, steps=8, kv_cache_gb=1.0,
                            quality_prompts=48, quality_prompt_len=512, quality_tokens=64,
                            task_prompts=300)
QUICK: dict[str, Any] = dict(batches=[1, 4], context=128, rounds=2, steps=3, kv_cache_gb=0.05,
                             quality_prompts=4, quality_prompt_len=64, quality_tokens=8,
                             task_prompts=10)
CACHES = ("auto", "int8")


def _engine(ckpt: str, threads: int, kv_cache_dtype: str, **more: Any) -> Any:
    from evenflow.engine.serving.engine import Engine, EngineConfig

    settings: dict[str, Any] = {"max_num_batched_tokens": 4096, "max_num_seqs": 64, **more}
    return Engine(EngineConfig(model=ckpt, num_threads=threads, kv_cache_dtype=kv_cache_dtype,
                               **settings))


def run_speed(ckpt: str, threads: int, plan: dict) -> dict:
    """Blocks per kv_cache_gb, and each batch's alternating decode rounds (ms/step each)."""
    result: dict[str, Any] = {"blocks": {}, "decode_ms": {}}
    for cache in CACHES:
        result["blocks"][cache] = _engine(ckpt, threads, cache, max_num_seqs=4096,
                                          kv_cache_gb=plan["kv_cache_gb"]).num_kv_blocks
    ids = iter(range(10**9))
    for b in plan["batches"]:
        blocks = decode_blocks(b, plan["context"], plan["rounds"] * plan["steps"])
        engines = {c: _engine(ckpt, threads, c, num_kv_blocks=blocks) for c in CACHES}
        result["decode_ms"][b] = alternating_decode(engines, b, plan["context"],
                                                    plan["rounds"], plan["steps"], ids)
        del engines
    return result


def run_quality(ckpt: str, threads: int, plan: dict) -> dict:
    """Greedy tokens of the model-dtype cache, the int8 cache and float32 (model-dtype cache)."""
    from evenflow.proto.sampling import SamplingParams

    out: dict[str, list[list[int]]] = {}
    for name, cache, dtype in (("auto", "auto", "auto"), ("int8", "int8", "auto"),
                               ("float32", "auto", "float32")):
        engine = _engine(ckpt, threads, cache, dtype=dtype, num_kv_blocks=4096)
        prompts = random_prompts(plan["quality_prompts"], plan["quality_prompt_len"],
                                 engine.model_config.vocab_size, 1234)
        params = SamplingParams(temperature=0, max_tokens=plan["quality_tokens"],
                                ignore_eos=True)
        tokens: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
            tokens[str(i)] = []
        while engine.has_unfinished():
            for o in engine.step():
                tokens[o.request_id].extend(o.new_token_ids)
        out[name] = [tokens[str(i)] for i in range(len(prompts))]
    return out


def run_tasks(cache: str, threads: int, plan: dict) -> dict:
    from evenflow.bench.offline.quant_bench import task_accuracy

    return task_accuracy(threads, plan, kv_cache_dtype=cache)


def _worker(argv: list[str]) -> int:
    kind, ckpt, threads, plan = argv[0], argv[1], int(argv[2]), json.loads(argv[3])
    if kind == "speed":
        print(json.dumps(run_speed(ckpt, threads, plan)))
    elif kind == "quality":
        print(json.dumps(run_quality(ckpt, threads, plan)))
    else:
        print(json.dumps(run_tasks(kind.removeprefix("tasks-"), threads, plan)))
    return 0


def _spawn(kind: str, ckpt: str, threads: int, plan: dict) -> dict | None:
    return run_worker("evenflow.bench.offline.kv_cache_bench", [kind, ckpt, str(threads),
                                                        json.dumps(plan)], threads, kind)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    ap = argparse.ArgumentParser(prog="evenflow bench engine --kv-cache-dtype int8",
                                 description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--checkpoint-dir", default=None)
    ap.add_argument("--context", type=int, default=None, help="decode context (default 2048)")
    args = ap.parse_args(argv)

    from evenflow.bench.checkpoint import benchmark_checkpoint
    from evenflow.bench.offline.quant_bench import agreement

    plan = dict(QUICK if args.quick else FULL)
    if args.context:
        plan["context"] = args.context
    ckpt, dtype = benchmark_checkpoint(args.quick, args.checkpoint_dir, args.threads)
    print(f"checkpoint: {ckpt} (random Mixtral-style MoE); the model computes in {dtype}; "
          f"'auto' is the KV cache in {dtype}")
    speed = _spawn("speed", ckpt, args.threads, plan)
    quality = _spawn("quality", ckpt, args.threads, plan)
    tasks = {c: _spawn(f"tasks-{c}", ckpt, args.threads, plan) for c in CACHES}
    if speed is not None:
        auto, int8 = speed["blocks"]["auto"], speed["blocks"]["int8"]
        print(f"\ncapacity: {plan['kv_cache_gb']} GiB of KV cache holds {auto} blocks in "
              f"{dtype}, {int8} in int8 ({int8 / auto:.2f}x)")
        print(f"\ndecode, {plan['context']}-token contexts, both caches in one process "
              f"alternating ({plan['rounds']} rounds of {plan['steps']} steps; ms/step medians; "
              f"ratio = {dtype} time / int8 time, median of the rounds' [min-max])")
        print(f"{'batch':>6}{dtype:>12}{'int8':>10}   ratio")
        for b, rounds in speed["decode_ms"].items():
            each = [a / q for a, q in zip(rounds["auto"], rounds["int8"], strict=True)]
            print(f"{b:>6}{statistics.median(rounds['auto']):12.2f}"
                  f"{statistics.median(rounds['int8']):10.2f}   {statistics.median(each):.2f}x "
                  f"[{min(each):.2f}-{max(each):.2f}]")
    if quality is not None:
        floor = agreement(quality["auto"], quality["float32"])[2]
        share = agreement(quality["auto"], quality["int8"])[2]
        print(f"\nquality: {plan['quality_prompts']} prompts of {plan['quality_prompt_len']} "
              f"tokens, {plan['quality_tokens']} greedy tokens, agreement with the {dtype} "
              "cache (% of positions)")
        print(f"  float32 model (the noise floor): {floor:.1f}%   int8 cache: {share:.1f}%   "
              f"difference {share - floor:+.1f} ({'pass' if share - floor >= -5 else 'FAIL'}: "
              ">= -5)")
    if all(tasks.values()):
        print(f"\ntiny-moe tasks: exact-match accuracy %, {plan['task_prompts']} prompts each "
              "(pass: int8 within 1 point)")
        for task in tasks["auto"]:  # type: ignore[union-attr]
            a, q = tasks["auto"][task], tasks["int8"][task]  # type: ignore[index]
            print(f"  {task:12}{a:8.1f}{q:8.1f}   {'pass' if abs(a - q) <= 1 else 'FAIL'}")
    return 0 if speed and quality and all(tasks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
