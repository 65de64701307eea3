"""llama.cpp beside evenflow, on the same weights: `bench engine --llamacpp DIR` (the model
dtype) and `bench quant --llamacpp DIR` (also int8 against Q8_0, int4 against Q4_0).

DIR holds a llama.cpp build (llama-bench and llama-batched-bench, in DIR, DIR/bin or
DIR/build/bin; README "Benchmarks" says how to build it here). The benchmark checkpoint is
written as GGUF by models/gguf_export.py (llama.cpp's layout). Each round runs evenflow (its own
process: decode at each batch size after a 128-token prompt, prefill at each length) and then
llama.cpp (llama-batched-bench for the same decode shapes, llama-bench for prefill), so noise on
a shared host hits both alike; a ratio is the median of the rounds' ratios (llama.cpp time /
evenflow time: > 1 means evenflow is faster), its spread printed.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from evenflow.bench.machine import run_worker

PLAN: dict[str, Any] = dict(batches=[1, 8, 32], prompt=128, output=64, prefills=[128, 512, 2048],
                            rounds=5)
QUICK_PLAN: dict[str, Any] = dict(batches=[1, 4], prompt=16, output=8, prefills=[64], rounds=2)


def native_variant(dtype: str) -> tuple[str, tuple[dict, str]]:
    """The unquantized row: evenflow in `dtype` against the GGUF of the same width."""
    return dtype, ({"dtype": dtype}, "bf16" if dtype == "bfloat16" else "f32")


def tool(directory: str, name: str) -> Path:
    for sub in ("", "bin", "build/bin"):
        path = Path(directory) / sub / name
        if path.is_file():
            return path
    raise FileNotFoundError(f"no {name} under {directory} (nor its bin/ or build/bin/)")


def _batched_rows(command: list[str], wanted: int, tries: int = 3) -> list[dict]:
    """llama-batched-bench's JSON rows. Its rows go through llama.cpp's asynchronous logger,
    which now and then exits before writing them all (seen in ~1 run of 12 into a file, more
    into a pipe): a run short of rows is repeated."""
    for _ in range(tries):
        with tempfile.TemporaryFile("w+") as out:
            subprocess.run(command, stdout=out, stderr=subprocess.DEVNULL, check=True)
            out.seek(0)
            rows = [json.loads(line) for line in out if line.startswith("{")]
        if len(rows) == wanted:
            return rows
    raise RuntimeError(f"llama-batched-bench gave {len(rows)} of {wanted} rows {tries} times")


def llamacpp_round(directory: str, gguf: Path, threads: int, plan: dict) -> dict:
    """One round of llama.cpp: decode ms/step per batch, prefill ms per length."""
    rows = _batched_rows(
        [str(tool(directory, "llama-batched-bench")), "-m", str(gguf), "-t", str(threads),
         "-npp", str(plan["prompt"]), "-ntg", str(plan["output"]),
         "-npl", ",".join(map(str, plan["batches"])),
         "-c", str(max(4096, 2 * max(plan["batches"]) * (plan["prompt"] + plan["output"]))),
         "--output-format", "jsonl"], len(plan["batches"]))
    decode = {int(row["pl"]): row["t_tg"] / plan["output"] * 1e3 for row in rows}
    bench = subprocess.run(
        [str(tool(directory, "llama-bench")), "-m", str(gguf), "-t", str(threads), "-p",
         ",".join(map(str, plan["prefills"])), "-n", "0", "-r", "1", "-o", "json"],
        capture_output=True, text=True, check=True)
    prefill = {int(r["n_prompt"]): r["n_prompt"] / r["avg_ts"] * 1e3
               for r in json.loads(bench.stdout) if r["n_prompt"]}
    return {"decode": decode, "prefill": prefill}


def evenflow_round(ckpt: str, threads: int, engine_args: dict, plan: dict) -> dict:
    """One round of evenflow in this process, the same shapes."""
    from evenflow.bench.stepping import drive, random_prompts
    from evenflow.engine.serving.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model=ckpt, num_threads=threads, max_num_seqs=64,
                                 max_num_batched_tokens=max(4096, max(plan["prefills"])),
                                 enable_prefix_caching=False, **engine_args))
    vocab = engine.model_config.vocab_size
    ids = iter(range(10**9))
    drive(engine, random_prompts(2, 32, vocab, 99), 4, ids)  # warm-up
    decode = {}
    for b in plan["batches"]:
        steps = drive(engine, random_prompts(b, plan["prompt"], vocab, b), plan["output"] + 1,
                      ids)
        decode[b] = statistics.median(steps[1:]) * 1e3  # (the first step is the prefill)
    prefill = {}
    for n in plan["prefills"]:
        drive(engine, random_prompts(1, n, vocab, n - 1), 1, ids)  # warm-up at this size
        prefill[n] = sum(drive(engine, random_prompts(1, n, vocab, n), 1, ids)) * 1e3
    return {"decode": decode, "prefill": prefill}


def compare(ckpt: Path, directory: str, threads: int,
            variants: dict[str, tuple[dict, str]], quick: bool = False) -> None:
    """Print, per variant (label: evenflow's engine arguments, the GGUF type llama.cpp runs),
    decode and prefill side by side over alternating rounds."""
    from evenflow.models.gguf_export import export_gguf

    plan = QUICK_PLAN if quick else PLAN
    tmp = Path(tempfile.mkdtemp(prefix="evenflow-llamacpp-"))
    try:
        print(f"\nllama.cpp ({directory}) on the same weights as GGUF, alternating with evenflow "
              f"({plan['rounds']} rounds; ms medians; ratio = llama.cpp time / evenflow time, "
              "median of the rounds' [min-max]; decode after a "
              f"{plan['prompt']}-token prompt)")
        print(f"{'':34}{'llama.cpp':>11}{'evenflow':>10}   ratio")
        for label, (engine_args, kind) in variants.items():
            gguf = export_gguf(ckpt, tmp / f"model-{kind}.gguf", kind)
            # "gguf": evenflow serves the very file llama.cpp runs (a K-quant mix as stored)
            served = str(gguf) if engine_args.get("gguf") else str(ckpt)
            engine_args = {k: v for k, v in engine_args.items() if k != "gguf"}
            ours: list[dict] = []
            theirs: list[dict] = []
            for _ in range(plan["rounds"]):
                result = run_worker("evenflow.bench.offline.llamacpp", [
                    served, str(threads), json.dumps(engine_args), json.dumps(plan)],
                    threads, f"evenflow {label}")
                if result is None:
                    return
                ours.append(result)
                theirs.append(llamacpp_round(directory, gguf, threads, plan))
            for part, keys, what in (("decode", plan["batches"], "decode batch {} (ms/step)"),
                                     ("prefill", plan["prefills"], "prefill {} tokens (ms)")):
                for key in keys:
                    mine = [r[part][str(key)] for r in ours]
                    other = [r[part][key] for r in theirs]
                    each = [o / m for o, m in zip(other, mine, strict=True)]
                    name = f"{label} vs {kind.upper()}: " + what.format(key)
                    print(f"{name:34}{statistics.median(other):11.2f}"
                          f"{statistics.median(mine):10.2f}   {statistics.median(each):.2f}x "
                          f"[{min(each):.2f}-{max(each):.2f}]")
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":  # a worker: one evenflow round, its JSON on the last line
    args = sys.argv[2:] if sys.argv[1:2] == ["--worker"] else sys.argv[1:]
    print(json.dumps(evenflow_round(args[0], int(args[1]), json.loads(args[2]),
                                    json.loads(args[3]))))
