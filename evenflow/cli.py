"""The `evenflow` command: `generate` (offline generation) and `bench` (benchmarks)."""

from __future__ import annotations

import argparse
import sys


def _generate(args: argparse.Namespace) -> int:
    from evenflow import LLM, SamplingParams
    from evenflow.engine.config import ModelLoadError
    from evenflow.proto.tokenizer import TokenizerError

    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
            max_tokens=args.max_tokens, stop=args.stop or (), ignore_eos=args.ignore_eos)
        llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads)
        if args.chat:
            outputs = [llm.chat([{"role": "user", "content": p}], params) for p in args.prompts]
        else:
            outputs = llm.generate(args.prompts, params)
    except (ValueError, ModelLoadError, TokenizerError) as exc:
        print(f"evenflow generate: error: {exc}", file=sys.stderr)
        return 2
    for prompt, out in zip(args.prompts, outputs, strict=True):
        if len(args.prompts) > 1 or args.verbose:
            print(f"# prompt: {prompt!r}  ({len(out.prompt_token_ids)} tokens, "
                  f"{len(out.token_ids)} generated, finish: {out.finish_reason})")
        print(out.text)
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.what == "engine":
        from evenflow.bench.engine_bench import main as bench_engine

        return bench_engine(args.rest)
    print(f"evenflow bench: unknown benchmark {args.what!r}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="evenflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline with the engine")
    gen.add_argument("prompts", nargs="+", help="prompt text(s); several are batched together")
    gen.add_argument("--model", default="tiny-moe", help="built-in model name or checkpoint dir")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat turn")
    gen.add_argument("--threads", type=int, default=None, help="torch threads")
    gen.add_argument("-v", "--verbose", action="store_true")
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="run a benchmark: `evenflow bench engine --help`")
    bench.add_argument("what", choices=["engine"])
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
