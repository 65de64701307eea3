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
    """One random weight in every stored form the kernels read."""
    import torch

    from evenflow.engine import prepack

    w = (torch.randn(n, k, generator=g) * 0.02).to(dtype)
    q4 = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    s4 = torch.rand(n, k // 64, generator=g) * 1e-2
    o4 = -8 * s4
    scale = torch.rand(n, generator=g) * 1e-3
    return {
        "w": w, "packed": prepack.pack(w) if prepack.available(dtype) else None,
        "q": torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
        "scale": scale, "scale_dtype": scale.to(dtype),
        "nibbles": (q4[:, 0::2] | (q4[:, 1::2] << 4)).contiguous(), "s4": s4, "o4": o4,
        "pack4": torch._convert_weight_to_int4pack_for_cpu(q4.to(torch.int32), 1),
        "scale_zeros": torch.stack([s4, o4 + 8 * s4], dim=-1).transpose(0, 1).to(dtype)
        .contiguous()}


def _kernels(x: Any, wt: dict[str, Any], ops: Any) -> dict[str, Callable[[], object] | None]:
    import torch
    import torch.nn.functional as F

    from evenflow.engine import prepack

    dtype = x.dtype
    return {
        "dense": (lambda: prepack.packed_linear(x, wt["packed"])) if wt["packed"] is not None
        else (lambda: F.linear(x, wt["w"])),
        "int8 torch": lambda: torch._weight_int8pack_mm(x, wt["q"], wt["scale_dtype"]),
        "int8 ours": (lambda: ops.int8_mm(x, wt["q"], wt["scale"])) if ops else None,
        "int8 deq": lambda: F.linear(x, wt["q"].to(dtype)) * wt["scale_dtype"],
        "int4 torch": lambda: torch._weight_int4pack_mm_for_cpu(x, wt["pack4"], 64,
                                                                 wt["scale_zeros"]),
        "int4 ours": (lambda: ops.int4_mm(x, wt["nibbles"], wt["s4"], wt["o4"], 64)) if ops
        else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evenflow bench kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="768x512,512x512,2048x512,512x1024",
                    help="N x K weights, comma-separated")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args(argv)

    import torch

    from evenflow.bench.machine import machine_line
    from evenflow.engine import native
    from evenflow.engine.config import cpu_has_bf16

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
    return 0
