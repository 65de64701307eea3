"""`evenflow bench load`: what each stored form costs to load and to hold. For every form a
checkpoint ships in (bf16 safetensors, GPT-OSS's MXFP4 experts, DeepSeek-V3's FP8 block-wise,
GGUF Q8_0 / Q6_K / Q5_K_M / Q4_K_M / Q4_0), one process loads it (the engine's dtype, a KV cache
of a few blocks) and reports:

- file: the checkpoint's weight bytes on disk (safetensors or the .gguf);
- resident: the loaded model's weight bytes as held (engine/weights/quantize_model.py's
  quantized_bytes: quantized forms at their stored size);
- final: the process's RSS after loading, less its RSS before (torch imported, the native
  kernels loaded): the weights plus the engine's fixed part (tokenizer, caches, buffers);
- peak: the process's peak RSS while loading, less the same: what the load needed at most.

The targets (issue 43): peak within 1.25x of final (converted tensor by tensor, never a whole
bf16 copy), resident within 1.3x of the file for the compact forms. A GGUF file is converted
into its checkpoint directory (models/gguf_import.py) by one process first, unmeasured (that
happens once per file); the figures are the engine's load of it.

The checkpoints are the benchmark's ~110M models in each family's shape (bench/checkpoint.py),
written under --checkpoint-dir (default: the user's cache: ~/.cache/evenflow/bench-checkpoints/).

`--speed`: each form's decode (ms/step at batch 1, 8 and 32 after 128-token prompts) and prefill
(ms for 512 tokens) against its family's bf16 checkpoint, and GPT-OSS's bf16 experts on the path
they took before the fused kernel's epilogues (`gpt_oss-bf16-unfused`: EVENFLOW_NATIVE_MOE=0,
the padded bmm and per-expert loops; it is also how MXFP4 experts ran when they were expanded at
load), and its attention on torch's windowed path (`gpt_oss-bf16-torch-attention`: the native
decode and prefill attention switched off, as sinks and windows ran before). Each variant runs
in its own process, the variants one after another in every round (--rounds), so drift on a
shared host reaches them alike; a ratio (baseline time / form's time, > 1: the form is faster)
is the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from evenflow.bench.machine import (
    bench_checkpoints,
    machine_line,
    peak_rss_mb,
    reset_peak_rss,
    run_worker,
)

FORMS = ("bf16", "mxfp4", "fp8", "gguf-q8_0", "gguf-q6_k", "gguf-q5_k_m", "gguf-q4_k_m",
         "gguf-q4_0")
# --speed: variant -> (checkpoint key, extra environment, the variant it is compared with)
SPEED: dict[str, tuple[str, dict[str, str], str]] = {
    "mixtral-bf16": ("bf16", {}, "mixtral-bf16"),
    "mixtral-q8_0": ("gguf-q8_0", {}, "mixtral-bf16"),
    "mixtral-q5_k_m": ("gguf-q5_k_m", {}, "mixtral-bf16"),
    # (its 5-bit tensors as int8 per channel, as they were held before the 5-bit panels, and are
    # where VNNI is not)
    "mixtral-q5_k_m-as-int8": ("gguf-q5_k_m", {"EVENFLOW_NATIVE_W4A8": "0"}, "mixtral-q5_k_m"),
    "mixtral-q4_k_m": ("gguf-q4_k_m", {}, "mixtral-bf16"),
    "gpt_oss-bf16-unfused": ("gpt_oss", {"EVENFLOW_NATIVE_MOE": "0"}, "gpt_oss-bf16-unfused"),
    "gpt_oss-bf16-torch-attention": ("gpt_oss", {"EVENFLOW_NATIVE_ATTENTION": "0",
                                                  "EVENFLOW_NATIVE_PREFILL_ATTENTION": "0"},
                                     "gpt_oss-bf16-unfused"),
    "gpt_oss-bf16": ("gpt_oss", {}, "gpt_oss-bf16-unfused"),
    # (its sliding layers in the one block table, as before they had a pool of their own)
    "gpt_oss-bf16-one-table": ("gpt_oss", {"EVENFLOW_WINDOW_POOL": "0"}, "gpt_oss-bf16"),
    "gpt_oss-mxfp4": ("mxfp4", {}, "gpt_oss-bf16-unfused"),
    "deepseek_v3-bf16": ("deepseek_v3", {}, "deepseek_v3-bf16"),
    "deepseek_v3-fp8": ("fp8", {}, "deepseek_v3-bf16"),
}
TARGET_PEAK, TARGET_FILE = 1.25, 1.3


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _write_mxfp4_gpt_oss(source: Path, out: Path) -> Path:
    """GPT-OSS as it ships: its stacked experts in MXFP4 (blocks + scales, (E, out, in))."""
    from safetensors.torch import load_file, save_file

    from evenflow.engine.quant import mxfp4

    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(source / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4.quantize(tensors.pop(name).float().transpose(1, 2))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            (out / path.name).write_bytes(path.read_bytes())
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["router", "self_attn", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def checkpoints(root: Path, quick: bool) -> dict[str, tuple[Path, str]]:
    """form -> (what to load, the file whose size is `file`)."""
    from evenflow.bench.checkpoint import (
        QUICK_MODEL,
        write_family,
        write_random_mixtral,
    )
    from evenflow.engine.weights.fp8_blockwise import write_fp8
    from evenflow.models.gguf_export import export_gguf

    tag = "quick" if quick else "110m"
    mixtral = write_random_mixtral(root / f"mixtral-{tag}", QUICK_MODEL if quick else None)
    gpt_oss = write_family(root / f"gpt_oss-{tag}", "gpt_oss", quick)
    deepseek = write_family(root / f"deepseek_v3-{tag}", "deepseek_v3", quick)
    out: dict[str, tuple[Path, str]] = {"bf16": (mixtral, "dir"), "gpt_oss": (gpt_oss, "dir"),
                                        "deepseek_v3": (deepseek, "dir")}
    out["mxfp4"] = (_write_mxfp4_gpt_oss(gpt_oss, root / f"gpt_oss-mxfp4-{tag}"), "dir")
    fp8 = root / f"deepseek_v3-fp8-{tag}"
    out["fp8"] = (fp8 if (fp8 / "config.json").is_file() else write_fp8(deepseek, fp8), "dir")
    for kind in ("q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0"):
        path = root / f"mixtral-{tag}-{kind}.gguf"
        if not path.is_file():
            export_gguf(mixtral, path, kind)
        out[f"gguf-{kind}"] = (path, "gguf")
    return out


def file_bytes(path: Path) -> int:
    if path.suffix == ".gguf":
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def _speed(model: str, dtype: str, quick: bool) -> dict[str, Any]:
    """Decode ms/step (median of a run's steps) per batch, and prefill ms, for one engine."""
    import statistics

    from evenflow.bench.stepping import drive, random_prompts
    from evenflow.engine.serving.engine import Engine, EngineConfig

    batches, prompt, output, prefill = ([1, 4], 16, 8, 64) if quick else ([1, 8, 32], 128, 32,
                                                                          512)
    engine = Engine(EngineConfig(model=model, dtype=dtype, max_num_seqs=64, num_kv_blocks=1024,
                                 max_num_batched_tokens=2048))
    vocab = engine.model_config.vocab_size
    ids = iter(range(10**9))
    drive(engine, random_prompts(2, 32, vocab, 99), 4, ids)  # warm-up
    drive(engine, random_prompts(1, prefill, vocab, 98), 1, ids)
    decode = {b: statistics.median(drive(engine, random_prompts(b, prompt, vocab, b), output,
                                         ids)[1:]) * 1e3 for b in batches}
    first = drive(engine, random_prompts(1, prefill, vocab, 7), 1, ids)
    return {"decode_ms": decode, "prefill_ms": sum(first) * 1e3}


def _worker(argv: list[str]) -> int:
    """Load one checkpoint; print {"before", "peak", "resident"} (MiB) as the last line (or,
    with `speed`, _speed's figures)."""
    import torch

    from evenflow import LLM
    from evenflow.engine.kernels import native
    from evenflow.engine.serving.engine import Engine
    from evenflow.engine.weights.quantize_model import quantized_bytes

    model, dtype, convert_only = argv[0], argv[1], argv[2:] == ["convert"]
    if argv[2:3] == ["speed"]:
        print(json.dumps(_speed(model, dtype, argv[3:] == ["quick"])))
        return 0
    if convert_only:
        from evenflow.models import resolve_model

        resolve_model(model)
        print(json.dumps({}))
        return 0
    native.ops()
    torch.zeros(1)
    reset_peak_rss()
    before = _status_mb("VmRSS")
    llm = LLM(model, dtype=dtype, num_kv_blocks=8, block_size=16)
    peak = peak_rss_mb()
    assert isinstance(llm.engine, Engine)
    resident = quantized_bytes(llm.engine.model) / 2**20
    print(json.dumps({"before": before, "peak": peak - before, "resident": resident,
                      "after": _status_mb("VmRSS") - before}))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    parser = argparse.ArgumentParser(prog="evenflow bench load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the small models (smoke run)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--forms", default=",".join(FORMS),
                        help=f"comma-separated, of {', '.join(FORMS)}")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--speed", action="store_true",
                        help="decode and prefill per form against its family's bf16")
    parser.add_argument("--rounds", type=int, default=3, help="--speed's rounds")
    parser.add_argument("--variants", default="",
                        help=f"--speed: comma-separated, of {', '.join(SPEED)} (default all)")
    args = parser.parse_args(argv)
    from evenflow.engine.config.settings import cpu_has_bf16

    dtype = "bfloat16" if cpu_has_bf16() else "float32"
    print(machine_line(dtype, args.threads))
    root = Path(args.checkpoint_dir or bench_checkpoints())
    forms = [f for f in args.forms.split(",") if f]
    unknown = sorted(set(forms) - set(FORMS))
    if unknown:
        parser.error(f"unknown forms {unknown} (of {', '.join(FORMS)})")
    paths = checkpoints(root, args.quick)
    if args.speed:
        return _speed_table(paths, dtype, args)
    rows: list[dict[str, Any]] = []
    for form in forms:
        path, _ = paths[form]
        if path.suffix == ".gguf":
            run_worker("evenflow.bench.offline.load_bench", [str(path), dtype, "convert"],
                       args.threads, form)
        got = run_worker("evenflow.bench.offline.load_bench", [str(path), dtype],
                         args.threads, form)
        if got is None:
            continue
        rows.append({"form": form, "file": file_bytes(path) / 2**20, **got})
    print(f"\n{'form':<14}{'file MiB':>10}{'resident':>10}{'final':>9}{'peak':>9}"
          f"{'res/file':>10}{'peak/final':>11}  targets: res/file <= {TARGET_FILE} (compact "
          f"forms), peak/final <= {TARGET_PEAK}")
    for r in rows:
        print(f"{r['form']:<14}{r['file']:>10.1f}{r['resident']:>10.1f}{r['after']:>9.1f}"
              f"{r['peak']:>9.1f}{r['resident'] / r['file']:>9.2f}x"
              f"{r['peak'] / r['after']:>10.2f}x")
    return 0


def _speed_table(paths: dict[str, tuple[Path, str]], dtype: str, args: Any) -> int:
    import statistics

    chosen = [v for v in args.variants.split(",") if v] or list(SPEED)
    unknown = sorted(set(chosen) - set(SPEED))
    if unknown:
        raise SystemExit(f"unknown variants {unknown} (of {', '.join(SPEED)})")
    speed = {v: SPEED[v] for v in chosen}
    for variant, (key, _, _) in speed.items():  # GGUF files: converted first, unmeasured
        if paths[key][0].suffix == ".gguf":
            run_worker("evenflow.bench.offline.load_bench", [str(paths[key][0]), dtype, "convert"],
                       args.threads, variant)
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(args.rounds):
        got: dict[str, dict[str, Any]] = {}
        for variant, (key, env, _) in speed.items():
            result = run_worker("evenflow.bench.offline.load_bench",
                                [str(paths[key][0]), dtype, "speed",
                                 *(["quick"] if args.quick else [])],
                                args.threads, variant, env=env)
            if result is not None:
                got[variant] = result
        rounds.append(got)
        print(f"round {r + 1} of {args.rounds} done", flush=True)
    batches = list(next(iter(rounds[0].values()))["decode_ms"])
    columns = [f"decode b{b}" for b in batches] + ["prefill"]

    def figure(result: dict[str, Any], column: str) -> float:
        if column == "prefill":
            return float(result["prefill_ms"])
        return float(result["decode_ms"][column.removeprefix("decode b")])

    print(f"\n{'variant':<22}" + "".join(f"{c + ' ms':>16}" for c in columns) +
          "  (median ms; ratio = baseline / this, median of the rounds)")
    for variant, (_, _, base) in speed.items():
        cells = []
        for c in columns:
            mine = [figure(rd[variant], c) for rd in rounds if variant in rd]
            ratios = [figure(rd[base], c) / figure(rd[variant], c) for rd in rounds
                      if variant in rd and base in rd]
            if not mine:
                cells.append(f"{'-':>16}")
                continue
            text = f"{statistics.median(mine):.2f}"
            if base != variant and ratios:
                text += f" {statistics.median(ratios):.2f}x"
            cells.append(f"{text:>16}")
        print(f"{variant:<22}" + "".join(cells) + (f"  vs {base}" if base != variant else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
