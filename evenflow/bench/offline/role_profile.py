"""`evenflow profile-roles`: what a prefill and a decode worker cost on this machine, measured
from the real engine, as the planner (evenflow/planner/) and the planner's benchmark's mock
workers use it: seconds per prompt token (prefill of `--prompt-len` tokens, median of rounds),
a decode step's fixed seconds and seconds per running sequence (a least-squares line through
the median step at each batch of `--batches`), and a worker's start (the worker module's
import in a fresh interpreter plus the engine's construction here). Written as JSON
(`--output`), with the machine line."""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import time


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - slope * mx, slope


def measure(model: str, threads: int, prompt_len: int, batches: list[int], rounds: int,
            steps: int) -> dict[str, float | str]:
    import torch

    from evenflow.bench.stepping import random_prompts
    from evenflow.engine.config.settings import EngineConfig
    from evenflow.engine.serving.engine import Engine
    from evenflow.proto.sampling import SamplingParams

    torch.set_num_threads(threads)
    started = time.perf_counter()
    engine = Engine(EngineConfig(model=model, num_threads=threads, max_num_seqs=max(batches),
                                 num_kv_blocks=max(batches) * 48 + 4 * prompt_len // 16 + 64,
                                 max_num_batched_tokens=max(2048, prompt_len),
                                 enable_prefix_caching=False))
    build_s = time.perf_counter() - started
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import evenflow.decode.service"], check=True)
    import_s = time.perf_counter() - t0
    vocab, ids = engine.model_config.vocab_size, itertools.count()
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prefill = []
    for r in range(rounds + 1):  # (the first warms up)
        engine.add_request(str(next(ids)), random_prompts(1, prompt_len, vocab, r)[0], one)
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        if r:
            prefill.append((time.perf_counter() - t) / prompt_len)
    points = []
    for batch in batches:
        params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
        for p in random_prompts(batch, 32, vocab, batch):
            engine.add_request(str(next(ids)), p, params)
        while engine.num_waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                        for s in engine.scheduler.running):
            engine.step()
        times = []
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        points.append((float(batch), statistics.median(times[1:-1] or times)))
    base, per_seq = _line(points)
    return {"prefill_s_per_token": statistics.median(prefill),
            "decode_s_base": max(base, 1e-5), "decode_s_per_seq": max(per_seq, 1e-7),
            "worker_start_s": build_s + import_s, "engine_build_s": build_s, "model": model,
            "threads": threads,
            "prompt_len": prompt_len,
            "decode_points": ", ".join(f"{int(b)}: {t * 1e3:.2f} ms" for b, t in points)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evenflow profile-roles", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-moe")
    ap.add_argument("--threads", type=int, default=1, help="as a mesh worker runs (1)")
    ap.add_argument("--prompt-len", type=int, default=384)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--output", default="roles-profile.json")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)

    from evenflow.bench.machine import machine_line
    from evenflow.planner.profile import RoleProfile

    line = machine_line("bf16/auto", args.threads)
    print(line)
    found = measure(args.model, args.threads, args.prompt_len,
                    [int(b) for b in args.batches.split(",")], args.rounds, args.steps)
    profile = RoleProfile(**{k: float(found[k]) for k in (
        "prefill_s_per_token", "decode_s_base", "decode_s_per_seq", "worker_start_s")})
    profile.save(args.output, model=args.model, threads=args.threads, machine=line,
                 decode_points=found["decode_points"], engine_build_s=found["engine_build_s"])
    print(f"prefill {profile.prefill_s_per_token * 1e6:.1f} us/token ({args.prompt_len}-token "
          f"prompts); decode step {profile.decode_s_base * 1e3:.2f} ms + "
          f"{profile.decode_s_per_seq * 1e3:.3f} ms/sequence ({found['decode_points']}); "
          f"worker start {profile.worker_start_s:.1f} s")
    print(f"written to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
