"""`evenflow bench lora`: decode tokens/s of a batch of 8 with 0, 1 and 4 LoRA adapters in it
(engine/model/lora.py), on the built-in tiny-moe (or --model). The adapters are random rank-r
factors on attention q/k/v/o and on every routed expert's gate_up and down, written in PEFT's
checkpoint format (what PEFT's target_parameters saves for transformers' fused experts); one
more row has an adapter on attention alone.
Configurations alternate round by round; the table gives medians and the ratio to the batch
without adapters, measured in the same run."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

BATCH, NEW_TOKENS, PROMPT = 8, 64, 32


def write_adapter(path: Path, model_dir: Path, rank: int, seed: int,
                  experts: bool = True) -> None:
    """Random LoRA factors in PEFT's layout for every attention projection (and expert)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config") or cfg
    H, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads",
                                                    cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or H // heads
    E = cfg.get("num_local_experts", 0) if experts else 0
    inter = cfg.get("intermediate_size")
    g = torch.Generator().manual_seed(seed)

    def pair(prefix: str, rows_a: int, cols_a: int, rows_b: int) -> dict:
        return {f"{prefix}.lora_A.weight": torch.randn(rows_a, cols_a, generator=g) * 0.05,
                f"{prefix}.lora_B.weight": torch.randn(rows_b, rows_a, generator=g) * 0.05}

    tensors: dict = {}
    for layer in range(layers):
        base = f"base_model.model.model.layers.{layer}"
        for name, out in (("q_proj", heads * hd), ("k_proj", kv * hd), ("v_proj", kv * hd),
                          ("o_proj", H)):
            tensors |= pair(f"{base}.self_attn.{name}", rank, heads * hd if name == "o_proj"
                            else H, out)
        if E:
            tensors |= pair(f"{base}.mlp.experts.base_layer", rank * E, H, 2 * inter)
            tensors |= pair(f"{base}.mlp.experts", rank * E, inter, H)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "target_parameters": ["experts.gate_up_proj", "experts.down_proj"] if E else None}))


def _tokens_per_s(llm, prompts: list[list[int]], adapters: list[str], root: Path) -> float:
    from evenflow import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                             lora_name=name, lora_path=str(root / name) if name else "")
              for name in adapters]
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    return sum(len(o.token_ids) for o in outputs) / elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evenflow bench lora", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-moe")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)

    import torch

    from evenflow import LLM, models
    from evenflow.bench.machine import machine_line

    torch.set_num_threads(args.threads)
    model_dir = models.resolve_model(args.model)
    assert model_dir is not None, f"unknown model {args.model}"
    llm = LLM(args.model)
    dtype = str(getattr(llm.engine, "dtype", "")).removeprefix("torch.")
    print(machine_line(dtype, args.threads))
    root = Path(tempfile.mkdtemp(prefix="evenflow-lora-bench-"))
    for i in range(4):
        write_adapter(root / f"a{i}", model_dir, args.rank, seed=i)
    write_adapter(root / "attn", model_dir, args.rank, seed=9, experts=False)
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (PROMPT,), generator=g).tolist() for _ in range(BATCH)]
    configs = {"0 adapters": [""] * BATCH, "1 adapter": ["a0"] * BATCH,
               "4 adapters": [f"a{i % 4}" for i in range(BATCH)],
               "1 (attention only)": ["attn"] * BATCH}
    for adapters in configs.values():  # warm: adapters loaded, kernels built
        _tokens_per_s(llm, prompts[:2], adapters[:2], root)
    runs: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, adapters in configs.items():
            runs[name].append(_tokens_per_s(llm, prompts, adapters, root))
    base = statistics.median(runs["0 adapters"])
    print(f"\nLoRA rank {args.rank} on attention q/k/v/o and every expert, {args.model}; batch "
          f"{BATCH}, {PROMPT}-token prompts, {NEW_TOKENS} tokens each, greedy; tokens/s "
          f"medians of {args.rounds} alternating rounds")
    print(f"{'adapters in the batch':>22} {'tok/s':>9} {'vs none':>8}")
    for name, values in runs.items():
        print(f"{name:>22} {statistics.median(values):9.1f} "
              f"{statistics.median(values) / base:7.2f}x")
    print(f"lora: 0 / 1 / 4 adapters in a batch of {BATCH}: " + " / ".join(
        f"{statistics.median(runs[n]):.0f}" for n in ("0 adapters", "1 adapter", "4 adapters"))
        + " tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
