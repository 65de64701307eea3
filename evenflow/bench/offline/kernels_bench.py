"""`evenflow bench kernels`: the weight-only matmul kernels one by one, per weight shape and row
count, against the unquantized weight in the machine's native dtype.

For each shape (N outputs x K inputs; defaults: the bench 110M Mixtral's linear layers) and row
count, every kernel runs in the same rounds, one call each in turn (so a noisy neighbour slows
them alike), and the table gives each one's median time:
- `dense`: the unquantized weight, oneDNN-packed as the engine runs it (the baseline);
- `int8 torch` / `int4 torch`: torch's packed kernels (`_weight_int8pack_mm`,
  `_weight_int4pack_mm_for_cpu`, group 64);
- `int8 ours` / `int4 ours`: engine/kernels/weight_only.cpp;
- `int8 deq`: dequantize the weight, then the dense matmul (what the engine uses for many rows).
Ratios: dense time / kernel time (> 1: faster than unquantized), and torch / ours.

Then decode attention over the paged KV cache, per batch size (the 110M model's heads: 8 query
heads, 2 KV heads, head_dim 64; `--context` tokens each, scattered over the cache): torch's path
(gather K and V with index_select, then scaled_dot_product_attention with a padding mask) against
engine/kernels/paged_attention.cpp, which reads K and V in place. The engine uses the kernel at
every batch size where it keeps the head shape in registers (this one, on AVX-512 builds), else
up to `PAGED_ATTENTION_MAX_BATCH` decoding sequences (engine/model/attention.py), torch's path
above.

Then causal prefill attention per prompt length (same heads; the prompt's K and V in the cache):
torch's scaled_dot_product_attention (its CPU flash kernel, what the engine runs where ours does
not serve) against engine/kernels/prefill_attention.cpp, with each one's multiply-adds per second
(2 x heads x len^2 / 2 x head_dim).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any


def _shapes(text: str) -> list[tuple[int, int]]:
    return [(int(n), int(k)) for n, k in (s.split("x") for s in text.split(","))]


def _weights(n: int, k: int, dtype: Any, g: Any) -> dict[str, Any]:
    """One random weight, unquantized (oneDNN-packed as the engine runs it) and quantized by
    the engine's own quantizer into the stored forms its kernels read."""
    import torch

    from evenflow.engine.kernels.plan import NATIVE, KernelChoice
    from evenflow.engine.quant.stacks import Int4Stack, Int8Stack, QuantConfig, quantize
    from evenflow.engine.weights import prepack

    w = torch.randn(n, k, generator=g) * 0.02
    int8 = Int8Stack.build([quantize(w, QuantConfig("int8"))], dtype)
    int4 = [quantize(w, QuantConfig("int4", 64))]
    scale, offset = Int4Stack.scale_offset(int4)
    dense = w.to(dtype)
    return {"dense": dense, "packed": prepack.pack(dense) if prepack.available(dtype) else None,
            "int8": int8, "int4 packed": Int4Stack._packed(int4, scale, offset, dtype),
            "int4 nibbles": Int4Stack._plain(int4, scale, offset, dtype,
                                             KernelChoice((NATIVE,)))}


def _kernels(x: Any, wt: dict[str, Any], ops: Any) -> dict[str, Callable[[], object] | None]:
    """Each kernel on `x`, through the engine's own stored forms and entry points."""
    import torch.nn.functional as F

    from evenflow.engine.kernels.plan import DENSE, NATIVE, PACKED, KernelChoice
    from evenflow.engine.quant.stacks import Int8Stack
    from evenflow.engine.weights import prepack

    def int8(kernel: int) -> Callable[[], object]:
        stack = Int8Stack(wt["int8"].q, wt["int8"].scale, KernelChoice((kernel,)))
        return lambda: stack.linear(x)

    nibbles = wt["int4 nibbles"]
    return {
        "dense": (lambda: prepack.packed_linear(x, wt["packed"])) if wt["packed"] is not None
        else (lambda: F.linear(x, wt["dense"])),
        "int8 torch": int8(PACKED), "int8 ours": int8(NATIVE) if ops else None,
        "int8 deq": int8(DENSE), "int4 torch": lambda: wt["int4 packed"].linear(x),
        "int4 ours": (lambda: nibbles._native(x)) if ops and nibbles.ops else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evenflow bench kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="768x512,512x512,2048x512,512x1024",
                    help="N x K weights, comma-separated")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--attention-batches", default="1,2,4,8,16,32")
    ap.add_argument("--context", type=int, default=160, help="tokens per sequence (attention)")
    ap.add_argument("--prefill-lengths", default="128,512,2048",
                    help="prompt lengths for the prefill attention table")
    ap.add_argument("--prefill-rounds", type=int, default=7)
    args = ap.parse_args(argv)

    import torch

    from evenflow.bench.machine import machine_line
    from evenflow.engine.config.settings import cpu_has_bf16
    from evenflow.engine.kernels import native

    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if cpu_has_bf16() else torch.float32
    print(machine_line(str(dtype).removeprefix("torch."), args.threads))
    ops = native.ops()
    if ops is None:
        print("our kernels are unavailable here (no C++ compiler, or EVENFLOW_NATIVE_KERNELS=0)")
    names = ["dense", "int8 torch", "int8 ours", "int8 deq", "int4 torch", "int4 ours"]
    print(f"median µs per call over {args.rounds} rounds; ratio = dense / kernel\n")
    print(f"{'shape':>10} {'rows':>4}" + "".join(f"{n:>11}" for n in names)
          + "   int8 ours/dense  int8 torch/ours  int4 torch/ours")
    g = torch.Generator().manual_seed(0)
    for n, k in _shapes(args.shapes):
        weights = _weights(n, k, dtype, g)
        for m in (int(r) for r in args.rows.split(",")):
            kernels = _kernels(torch.randn(m, k, generator=g).to(dtype), weights, ops)
            times: dict[str, list[float]] = {name: [] for name in names}
            for _ in range(args.rounds + 2):  # the first two rounds warm up
                for name in names:
                    fn = kernels[name]
                    if fn is None:
                        continue
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            med = {name: statistics.median(t[2:]) * 1e6 if t else float("nan")
                   for name, t in times.items()}
            print(f"{n:>5}x{k:<4} {m:>4}" + "".join(f"{med[name]:11.1f}" for name in names)
                  + f"   {med['dense'] / med['int8 ours']:14.2f}x"
                  f" {med['int8 torch'] / med['int8 ours']:15.2f}x"
                  f" {med['int4 torch'] / med['int4 ours']:15.2f}x")
    _attention_table([int(b) for b in args.attention_batches.split(",")], args.context,
                     args.rounds, dtype, g)
    _prefill_attention_table([int(n) for n in args.prefill_lengths.split(",")],
                             args.prefill_rounds, dtype, g)
    return 0


def _attention_table(batches: list[int], context: int, rounds: int, dtype: Any,
                     g: Any) -> None:
    from evenflow.engine.kernels import native
    from evenflow.engine.model.attention import PAGED_ATTENTION_MAX_BATCH

    paged = native.decode_attention()
    use = ("at every batch (its register path serves these heads)"
           if native.decode_attention_registers(64, 4)
           else f"up to batch {PAGED_ATTENTION_MAX_BATCH}")
    print(f"\ndecode attention, {context} tokens per sequence: median µs per layer call "
          f"(the engine uses ours {use})")
    print(f"{'batch':>5} {'torch':>9} {'ours':>9} {'torch/ours':>11}")
    for b in batches:
        med = _time_attention(b, context, rounds, dtype, g, paged)
        ours = med.get("ours", float("nan"))
        print(f"{b:>5} {med['torch']:9.1f} {ours:9.1f} {med['torch'] / ours:10.2f}x")


def _time_attention(b: int, context: int, rounds: int, dtype: Any, g: Any,
                    paged: Any) -> dict[str, float]:
    """Median µs of torch's decode attention path and of ours, in the same rounds."""
    import torch

    from evenflow.engine.model.attention import gathered_decode_attention

    heads, kv_heads, hd = 8, 2, 64
    slots_total = b * context * 2
    q = torch.randn(b, heads, hd, generator=g).to(dtype)
    k_cache, v_cache = (torch.randn(slots_total, kv_heads, hd, generator=g).to(dtype)
                        for _ in range(2))
    slots = torch.stack([torch.randperm(slots_total, generator=g)[:context] for _ in range(b)])
    lens = torch.full((b,), context)
    mask = torch.zeros(b, 1, 1, context, dtype=dtype)

    fns: dict[str, Callable[[], object]] = {
        "torch": lambda: gathered_decode_attention(q, k_cache, v_cache, slots, mask)}
    if paged is not None:
        fns["ours"] = lambda: paged(q, k_cache, v_cache, slots, lens, hd**-0.5)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds + 2):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t[2:]) * 1e6 for name, t in times.items()}


def _prefill_attention_table(lengths: list[int], rounds: int, dtype: Any, g: Any) -> None:
    from evenflow.engine.kernels import native

    heads, kv_heads, hd = 8, 2, 64
    kernel = native.prefill_attention()
    serves = native.prefill_attention_serves(dtype, hd, heads // kv_heads)
    print(f"\ncausal prefill attention ({heads} heads, {kv_heads} KV heads of {hd}): median ms "
          f"per layer call over {rounds} rounds (the engine uses ours here: "
          f"{'yes' if serves else 'no'})")
    print(f"{'tokens':>6} {'torch':>9} {'ours':>9} {'torch/ours':>11} {'torch GMAC/s':>13} "
          f"{'ours GMAC/s':>12}")
    for n in lengths:
        med = _time_prefill_attention(n, rounds, dtype, g, kernel if serves else None)
        ours = med.get("ours", float("nan"))
        macs = 2 * heads * n * n / 2 * hd
        print(f"{n:>6} {med['torch']:9.2f} {ours:9.2f} {med['torch'] / ours:10.2f}x "
              f"{macs / med['torch'] / 1e6:13.1f} {macs / ours / 1e6:12.1f}")


def _time_prefill_attention(n: int, rounds: int, dtype: Any, g: Any,
                            kernel: Any) -> dict[str, float]:
    """Median ms of torch's causal attention over an n-token prompt and of ours (the 110M
    model's heads), in the same rounds."""
    import torch
    import torch.nn.functional as F

    heads, kv_heads, hd = 8, 2, 64
    qk = torch.randn(n, heads + kv_heads, hd, generator=g).to(dtype)
    k_cache, v_cache = (torch.randn(n + 1, kv_heads, hd, generator=g).to(dtype)
                        for _ in range(2))
    slots = torch.arange(n)
    q = qk[:, :heads]  # a view into the fused projection, as the model hands it over
    qs = q.transpose(0, 1).unsqueeze(0)
    ks = k_cache[:n].transpose(0, 1).unsqueeze(0)
    vs = v_cache[:n].transpose(0, 1).unsqueeze(0)
    fns: dict[str, Callable[[], object]] = {"torch": lambda: F.scaled_dot_product_attention(
        qs, ks, vs, is_causal=True, enable_gqa=True)}
    if kernel is not None:
        fns["ours"] = lambda: kernel(q, k_cache, v_cache, slots, hd**-0.5)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds + 1):  # the first round warms up
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t[1:]) * 1e3 for name, t in times.items()}
