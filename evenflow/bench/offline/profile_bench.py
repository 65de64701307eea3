"""`evenflow profile`: where the offline engine's time goes, operator by operator.

Runs torch.profiler over one prefill step (a batch of prompts) and then over N decode steps of
the same batch, and prints for each phase:
- the time per component (attention, MoE or MLP, norms, embedding + lm_head, sampler), from
  record_function ranges that forward hooks put around each module while profiling only;
- the top operators by self CPU time;
- the share of time in copies and layout changes (index_select, cat, copy_, contiguous, ...),
  the fusion candidates.
`--trace FILE` also writes a Chrome / Perfetto trace of the decode steps. (The table and the
ranges: engine/serving/profiling.py, which a mesh worker uses too: POST /admin/profile.)
"""

from __future__ import annotations

import argparse
import sys

from evenflow.bench.machine import bench_checkpoints
from evenflow.engine.config.settings import QUANT_METHODS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evenflow profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="default: the benchmarks' random 110M Mixtral")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16, help="decode steps profiled")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default=None, help="default: the CPU's native one")
    ap.add_argument("--quantization", default=None, choices=list(QUANT_METHODS))
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--trace", default=None, metavar="FILE",
                    help="write the decode steps as a Chrome/Perfetto trace")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)

    import torch

    from evenflow.bench.checkpoint import write_random_mixtral
    from evenflow.bench.machine import machine_line
    from evenflow.engine.config.settings import cpu_has_bf16
    from evenflow.engine.serving.engine import Engine, EngineConfig
    from evenflow.proto.sampling import SamplingParams

    dtype = args.dtype or ("bfloat16" if cpu_has_bf16() else "float32")
    print(machine_line(dtype, args.threads))
    model = args.model or str(write_random_mixtral(
        bench_checkpoints() / "mixtral-110m"))
    engine = Engine(EngineConfig(model=model, dtype=dtype, num_threads=args.threads,
                                 quantization=args.quantization,
                                 max_num_seqs=max(64, args.batch),
                                 max_num_batched_tokens=max(4096, args.batch * args.prompt_len)))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=args.steps + 4, ignore_eos=True)

    def add(tag: str) -> None:
        for i in range(args.batch):
            engine.add_request(f"{tag}{i}", torch.randint(3, vocab, (args.prompt_len,),
                                                          generator=g).tolist(), params)

    add("warm")
    while engine.has_unfinished():
        engine.step()
    add("p")
    engine.profile.start()  # component ranges, the sampler's included (engine/serving/profiling.py)
    engine.step()
    prefill = engine.profile.stop(1, phase="prefill", top=args.top)
    engine.profile.start()
    for _ in range(args.steps):
        engine.step()
    decode = engine.profile.stop(args.steps, args.trace or "", phase="decode", top=args.top)
    print(f"{model}: batch {args.batch}, {args.prompt_len}-token prompts, {dtype}, "
          f"quantization {args.quantization or 'none'}, "
          f"{args.threads} threads")
    print("\n".join(prefill))
    print("\n".join(decode))
    if args.trace:
        print(f"trace written to {args.trace} (chrome://tracing or ui.perfetto.dev)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
