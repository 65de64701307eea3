"""`evenflow bench engine --deterministic`: what deterministic mode (EngineConfig.deterministic)
costs, on the random 110M checkpoint in the machine's native dtype.

Both engines in one process: each phase's rounds alternate between them (default, then
deterministic, ...), and a ratio is the median of the rounds' ratios (deterministic time /
default time: > 1 means the mode is slower), its spread printed.
- decode ms/step at batch 1 and 32 (512-token contexts, prefilled untimed);
- prefill ms of one 512- and one 2,048-token prompt (the mode runs each prompt token as a
  decoded token runs, on the paged decode attention).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

FULL: dict[str, Any] = dict(batches=[1, 32], context=512, prefills=[512, 2048], rounds=5,
                            steps=8)
QUICK: dict[str, Any] = dict(batches=[1, 4], context=64, prefills=[64], rounds=2, steps=3)
MODES = ("default", "deterministic")


def _engine(ckpt: str, threads: int, mode: str, blocks: int) -> Any:
    from evenflow.engine.serving.engine import Engine, EngineConfig

    return Engine(EngineConfig(model=ckpt, num_threads=threads, num_kv_blocks=blocks,
                               max_num_seqs=64, max_num_batched_tokens=4096,
                               enable_prefix_caching=False,
                               deterministic=mode == "deterministic"))


def run(ckpt: str, threads: int, plan: dict) -> dict:
    from evenflow.bench.stepping import alternating_decode, decode_blocks, random_prompts
    from evenflow.proto.sampling import SamplingParams

    ids = iter(range(10**9))
    result: dict[str, Any] = {"decode": {}, "prefill": {}}
    for b in plan["batches"]:
        blocks = decode_blocks(b, plan["context"], plan["rounds"] * plan["steps"]) + 4
        engines = {m: _engine(ckpt, threads, m, blocks) for m in MODES}
        result["decode"][b] = alternating_decode(engines, b, plan["context"], plan["rounds"],
                                                 plan["steps"], ids)
        del engines
    for length in plan["prefills"]:
        engines = {m: _engine(ckpt, threads, m, length // 16 + 8) for m in MODES}
        vocab = engines["default"].model_config.vocab_size
        rounds: dict[str, list[float]] = {m: [] for m in MODES}
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=1)
        for r in range(plan["rounds"] + 1):
            prompt = random_prompts(1, length, vocab, 100 + r)[0]
            for mode, engine in engines.items():
                engine.add_request(str(next(ids)), prompt, params)
                t0 = time.perf_counter()
                while engine.has_unfinished():
                    engine.step()
                if r:  # (the first round warms up)
                    rounds[mode].append((time.perf_counter() - t0) * 1e3)
        result["prefill"][length] = rounds
        del engines
    return result


def _row(label: str, rounds: dict[str, list[float]]) -> str:
    each = [d / a for a, d in zip(rounds["default"], rounds["deterministic"], strict=True)]
    return (f"{label:22}{statistics.median(rounds['default']):11.2f}"
            f"{statistics.median(rounds['deterministic']):15.2f}   "
            f"{statistics.median(each):.2f}x [{min(each):.2f}-{max(each):.2f}]")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evenflow bench engine --deterministic",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--checkpoint-dir", default=None)
    args = ap.parse_args(argv)

    import torch

    from evenflow.bench.checkpoint import benchmark_checkpoint

    torch.set_num_threads(args.threads)
    plan = QUICK if args.quick else FULL
    ckpt, dtype = benchmark_checkpoint(args.quick, args.checkpoint_dir, args.threads)
    print(f"checkpoint: {ckpt} (random Mixtral-style MoE), in {dtype}")
    r = run(ckpt, args.threads, plan)
    print(f"\nms (medians of {plan['rounds']} alternating rounds; ratio = deterministic / "
          "default, median of the rounds' [min-max])")
    print(f"{'':22}{'default':>11}{'deterministic':>15}   ratio")
    for b, rounds in r["decode"].items():
        print(_row(f"decode batch {b}", rounds))
    for length, rounds in r["prefill"].items():
        print(_row(f"prefill {length} tokens", rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
