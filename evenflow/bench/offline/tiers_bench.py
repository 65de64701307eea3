"""`evenflow bench tiers`: multi-turn chat over a working set larger than the RAM KV cache,
with the KV disk tier (engine/runners/kv_tiers.py) against RAM only, on the random 110M
checkpoint.

Conversations take turns round-robin (every conversation's turn 1, then every turn 2, ...);
each turn's prompt is the conversation so far (its history, the engine's own answers, a new
user message). The RAM cache holds a quarter of the conversations' final KV (--ram-share), so
with RAM only a conversation's history is evicted before its next turn; the disk tier keeps it.
Both engines run in one process, alternating request by request (the same prompts, greedy),
one request at a time. Printed: the prefix-cache hit rate (cached prompt tokens / prompt
tokens) and TTFT p50 of the turns after the first, and the router's credit for a disk block:
1 - (promotion time per block / recompute time per block), measured here (the mesh's
kv_disk_credit default comes from this figure; services/config.py).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from typing import Any

FULL: dict[str, Any] = dict(conversations=16, history=512, turns=4, user=32, answer=16)
QUICK: dict[str, Any] = dict(conversations=6, history=48, turns=3, user=8, answer=4)
BLOCK = 16


def _final_blocks(plan: dict) -> int:
    tokens = plan["history"] + plan["turns"] * (plan["user"] + plan["answer"])
    return -(-tokens // BLOCK)


def _engine(ckpt: str, threads: int, ram_blocks: int, tier: str | None, disk_gb: float) -> Any:
    from evenflow.engine.serving.engine import Engine, EngineConfig

    return Engine(EngineConfig(model=ckpt, num_threads=threads, block_size=BLOCK,
                               num_kv_blocks=ram_blocks, max_num_batched_tokens=8192,
                               kv_disk_dir=tier or "", kv_disk_gb=disk_gb if tier else 0.0))


def _turn(engine: Any, rid: str, prompt: list[int], answer: int) -> tuple[float, int, list[int]]:
    """(TTFT seconds, cached prompt tokens, generated tokens) of one request run alone."""
    from evenflow.proto.sampling import SamplingParams

    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(temperature=0, ignore_eos=True,
                                                   max_tokens=answer))
    ttft, cached, tokens = 0.0, 0, list[int]()
    while engine.has_unfinished():
        for out in engine.step():
            if not tokens and out.new_token_ids:
                ttft, cached = time.perf_counter() - t0, out.num_cached_tokens
            tokens.extend(out.new_token_ids)
    return ttft, cached, tokens


def run(ckpt: str, threads: int, plan: dict, ram_share: float) -> dict:
    from evenflow.bench.stepping import random_prompts

    working_set = plan["conversations"] * _final_blocks(plan)
    ram_blocks = max(_final_blocks(plan) + 2, int(working_set * ram_share))
    root = tempfile.mkdtemp(prefix="evenflow-tiers-bench-")
    try:
        engines = {"ram only": _engine(ckpt, threads, ram_blocks, None, 0)}
        probe = engines["ram only"]
        block_bytes = probe.runner.kv_spec.bytes_per_block
        disk_gb = 2 * working_set * block_bytes / 2**30  # room for all of it
        engines["ram + disk"] = _engine(ckpt, threads, ram_blocks, root, disk_gb)
        vocab = probe.model_config.vocab_size
        histories = {name: [list(p) for p in random_prompts(
            plan["conversations"], plan["history"], vocab, 7)] for name in engines}
        users = random_prompts(plan["conversations"] * plan["turns"], plan["user"], vocab, 8)
        stats: dict[str, dict[str, list[float]]] = {
            name: {"ttft": [], "cached": [], "prompt": [], "recompute_s_per_block": []}
            for name in engines}
        rid = 0
        for turn in range(plan["turns"]):
            for conv in range(plan["conversations"]):
                user = users[turn * plan["conversations"] + conv]
                for name, engine in engines.items():  # alternating, request by request
                    prompt = histories[name][conv] + user
                    rid += 1
                    ttft, cached, answer = _turn(engine, f"r{rid}", prompt, plan["answer"])
                    histories[name][conv] = prompt + answer
                    if turn == 0:
                        continue  # nothing to reuse yet on either
                    s = stats[name]
                    s["ttft"].append(ttft)
                    s["cached"].append(cached)
                    s["prompt"].append(len(prompt))
                    if name == "ram only" and len(prompt) - cached >= 4 * BLOCK:
                        s["recompute_s_per_block"].append(ttft * BLOCK / (len(prompt) - cached))
        tiers = engines["ram + disk"].tiers
        result = {"ram_blocks": ram_blocks, "working_set_blocks": working_set,
                  "promoted": tiers.promoted, "saved": tiers.saved,
                  "promote_s_per_block": tiers.promote_s / max(1, tiers.promoted),
                  "save_s_per_block": tiers.save_s / max(1, tiers.saved)}
        for name, s in stats.items():
            result[name] = {"hit_rate": sum(s["cached"]) / max(1, sum(s["prompt"])),
                            "ttft_p50_ms": statistics.median(s["ttft"]) * 1e3,
                            "recompute_s_per_block": statistics.median(
                                s["recompute_s_per_block"]) if s["recompute_s_per_block"]
                            else None}
        for engine in engines.values():
            engine.close()
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


def disk_credit(promote_s_per_block: float, recompute_s_per_block: float) -> float:
    """A disk block's worth to the router, in RAM blocks: the share of its recompute time a
    promotion saves."""
    if recompute_s_per_block <= 0:
        return 0.0
    return max(0.0, min(1.0, 1 - promote_s_per_block / recompute_s_per_block))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evenflow bench tiers", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ram-share", type=float, default=0.25,
                    help="RAM KV cache as a share of the working set (default 0.25: 4x)")
    ap.add_argument("--checkpoint-dir", default=None)
    args = ap.parse_args(argv)

    import torch

    from evenflow.bench.checkpoint import benchmark_checkpoint

    torch.set_num_threads(args.threads)
    plan = QUICK if args.quick else FULL
    ckpt, dtype = benchmark_checkpoint(args.quick, args.checkpoint_dir, args.threads)
    r = run(ckpt, args.threads, plan, args.ram_share)
    print(f"checkpoint: {ckpt}; {plan['conversations']} conversations x {plan['turns']} turns "
          f"({plan['history']}-token history, +{plan['user']} user, {plan['answer']} answer "
          f"tokens a turn); working set {r['working_set_blocks']} blocks of {BLOCK}, RAM cache "
          f"{r['ram_blocks']} blocks ({r['working_set_blocks'] / r['ram_blocks']:.1f}x)")
    print("\nturns after the first, the two engines alternating request by request")
    print(f"{'':12}{'hit rate':>10}{'TTFT p50 ms':>14}")
    for name in ("ram only", "ram + disk"):
        print(f"{name:12}{r[name]['hit_rate'] * 100:9.1f}%{r[name]['ttft_p50_ms']:14.1f}")
    ratio = r["ram only"]["ttft_p50_ms"] / r["ram + disk"]["ttft_p50_ms"]
    print(f"TTFT p50, ram only / ram + disk: {ratio:.2f}x")
    recompute = r["ram only"]["recompute_s_per_block"]
    print(f"\nper block of {BLOCK} tokens: saved to disk {r['save_s_per_block'] * 1e3:.3f} ms, "
          f"promoted {r['promote_s_per_block'] * 1e3:.3f} ms ({r['promoted']} promoted), "
          f"recomputed {recompute * 1e3 if recompute else float('nan'):.3f} ms")
    if recompute:
        print(f"router credit of a disk block (kv_disk_credit = 1 - promote / recompute): "
              f"{disk_credit(r['promote_s_per_block'], recompute):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
