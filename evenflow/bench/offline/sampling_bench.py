"""`evenflow bench sampling`: what the OpenAI sampling features cost, in one run.

Batch-32 greedy decode on the bench's 110M Mixtral (tiny-moe with --quick), 2 threads, the
CPU's native dtype: the decode step (p50) with every request plain, then with every request
using presence/frequency/repetition penalties, logit_bias, min_tokens and 5 top logprobs, then
with every request guided by a grammar (structured output: a regex that never completes, so
the batch stays full; llguidance's masks for 32 rows each step). And what the features' code
costs a batch that does not use them: the time per step of the logits processing, grammar mask
and logprob passes on plain requests (they only check flags then), as a share of the plain
decode step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from evenflow.bench.machine import bench_checkpoints
from evenflow.bench.stepping import drive, random_prompts

_IDS = iter(range(10**9))


def _decode_steps(engine, params, batch: int, prompt: int, output: int, seed: int) -> list[float]:
    prompts = random_prompts(batch, prompt, engine.model_config.vocab_size, seed)
    return drive(engine, prompts, output, _IDS, params)[2:]  # past the prefill steps


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evenflow bench sampling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny-moe, fewer steps")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)

    import torch

    from evenflow.bench.checkpoint import write_random_mixtral
    from evenflow.bench.machine import machine_line
    from evenflow.engine.config.settings import cpu_has_bf16
    from evenflow.engine.core.sequence import Sequence
    from evenflow.engine.sample.logits_processing import process, record_logprobs
    from evenflow.engine.serving.engine import Engine, EngineConfig
    from evenflow.proto.grammar import guide_grammar
    from evenflow.proto.sampling import SamplingParams

    dtype = "bfloat16" if cpu_has_bf16() else "float32"
    print(machine_line(dtype, 2))
    model = "tiny-moe" if args.quick else str(
        write_random_mixtral(bench_checkpoints() / "mixtral-110m"))
    batch, output = 32, (16 if args.quick else 48)
    engine = Engine(EngineConfig(model=model, dtype=dtype, num_threads=2, max_num_seqs=64))
    plain = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    featured = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True,
                              presence_penalty=0.5, frequency_penalty=0.5,
                              repetition_penalty=1.1, logit_bias=((5, 1.0), (9, -1.0)),
                              min_tokens=4, logprobs=5)
    guided = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True,
                            guide=guide_grammar("regex", r"( [a-z0-9]+)+"))
    _decode_steps(engine, plain, batch, 64, output, 0)  # warm-up at the measured shape
    _decode_steps(engine, guided, batch, 64, output, 0)
    times: dict[str, list[float]] = {"plain": [], "all features": [], "guided": []}
    for round_ in range(3):  # interleaved: drift on a shared machine hits all alike
        for name, params in (("plain", plain), ("all features", featured), ("guided", guided)):
            times[name] += _decode_steps(engine, params, batch, 64, output, 10 * round_ + 1)
    rows = [(name, statistics.median(values) * 1e3) for name, values in times.items()]
    vocab = engine.model_config.vocab_size
    seqs = [Sequence(str(i), list(range(64 + output // 2)), 64, plain) for i in range(batch)]
    logits = torch.randn(batch, vocab)
    tokens = logits.argmax(-1).tolist()
    reps = 2000
    t0 = time.perf_counter()
    for _ in range(reps):
        record_logprobs(engine.guides.mask(process(logits, seqs, frozenset({2})), seqs), seqs,
                        tokens)
    unused_us = (time.perf_counter() - t0) / reps * 1e6
    plain_ms = rows[0][1]
    print(f"{model}: batch {batch} greedy decode, {output} new tokens per request")
    print(f"  {'requests':14} {'step p50 ms':>11} {'vs plain':>9}")
    for name, ms in rows:
        print(f"  {name:14} {ms:11.2f} {ms / plain_ms:8.3f}x")
    print(f"  the features' passes on a batch that does not use them: {unused_us:.1f} us per "
          f"step = {100 * unused_us / 1e3 / plain_ms:.2f}% of a plain decode step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
