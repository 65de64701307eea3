"""The memory-bandwidth limit of a batch-1 decode step, which `bench engine` and `bench quant`
print beside their timings.

- This machine's bandwidth: STREAM-style kernels (copy a = b, triad a = b + s * c, and a
  read-only sum, which is what streaming weights does) over float32 buffers 8x larger than the
  last-level cache, with the benchmark's thread count; the median of a few passes, in GB/s
  (10^9 bytes) as STREAM counts them (copy moves 2 words an element, triad 3, read 1).
- What a batch-1 step reads: every weight tensor of the model once, except the routed experts,
  of which only top_k of each MoE layer's slots are read, and the embedding, of which one row
  is read (unless lm_head shares it); plus the sequence's K/V at its context length.
On a small model part of that stays in the last-level cache between steps (the experts change
from token to token, attention and lm_head do not), so a step can read faster than memory
does. The host's bandwidth moves from run to run on a shared VM (45-94 GB/s read here): only
figures of one run compare.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

LLC_BYTES_GUESS = 64 * 2**20  # when the cache size cannot be read


def _llc_bytes() -> int:
    for index in (3, 2):
        try:
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        return int(text.rstrip("KMG")) * scale
    return LLC_BYTES_GUESS


def stream_bandwidth(threads: int, passes: int = 5) -> dict[str, float]:
    """GB/s of copy, triad and read with `threads` threads (medians of `passes`)."""
    torch.set_num_threads(threads)
    n = max(8 * _llc_bytes(), 256 * 2**20) // 4
    a, b, c = torch.zeros(n), torch.ones(n), torch.full((n,), 2.0)
    kernels = {"copy": (lambda: a.copy_(b), 2), "triad": (lambda: torch.add(b, c, alpha=3.0,
                                                                            out=a), 3),
               "read": (lambda: b.sum(), 1)}
    result = {}
    for name, (kernel, words) in kernels.items():
        kernel()  # (touch the pages)
        times = []
        for _ in range(passes):
            t0 = time.perf_counter()
            kernel()
            times.append(time.perf_counter() - t0)
        result[name] = words * 4 * n / statistics.median(times) / 1e9
    return result


def _tensors(obj: Any, seen: set[int], depth: int = 0) -> int:
    """Bytes of the tensors reachable from obj (its attributes, lists and dicts), each once."""
    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr() if obj.numel() else id(obj)
        if key in seen:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if depth > 4:
        return 0
    if isinstance(obj, nn.Module):
        return sum(_tensors(v, seen, depth + 1) for v in (
            *obj._parameters.values(), *obj._buffers.values(), *obj._modules.values(),
            *(v for k, v in vars(obj).items() if not k.startswith("_"))))
    if isinstance(obj, list | tuple):
        return sum(_tensors(v, seen, depth + 1) for v in obj)
    if isinstance(obj, dict):
        return sum(_tensors(v, seen, depth + 1) for v in obj.values())
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("evenflow"):
        return sum(_tensors(v, seen, depth + 1) for v in vars(obj).values())
    return 0


def step_bytes(engine: Any, context: int) -> tuple[int, int]:
    """(weight bytes, K/V bytes) a batch-1 decode step of `engine` reads at this context."""
    model = engine.model
    seen: set[int] = set()
    routed = always = 0
    for moe in model.moe_layers():  # routed experts: top_k of the layer's slots
        for part in (moe.gate, getattr(moe, "shared_expert", None),
                     getattr(moe, "shared_expert_gate", None)):
            if part is not None:
                always += _tensors(part, seen)  # read every step, not routed
        slots = max(1, getattr(moe, "num_slots", 0) or moe.num_experts)
        routed += _tensors(moe, seen) * moe.top_k // slots
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embed if hasattr(model.lm_head, "weight") else False
    if not tied:  # one embedding row
        seen.add(embed.untyped_storage().data_ptr())
        always += embed.shape[1] * embed.element_size()
    rest = _tensors(model, seen) + always
    cfg = engine.model_config
    kv_itemsize = 1 if engine.config.kv_cache_dtype == "int8" else \
        engine.runner.kv_caches[0][0].element_size()
    return rest + routed, cfg.kv_elements_per_token * kv_itemsize * context


def limit_line(label: str, ms: float, weights: int, kv: int, read_gbs: float) -> str:
    """One dtype's batch-1 row: bytes a step reads, the GB/s its time implies, the share."""
    rate = (weights + kv) / (ms / 1e3) / 1e9
    return (f"{label:14}{weights / 1e6:10.1f}{kv / 1e6:8.2f}{ms:10.2f}{rate:9.1f}"
            f"{100 * rate / read_gbs:9.0f}%")


LIMIT_HEADER = (f"{'':14}{'weights MB':>10}{'KV MB':>8}{'ms/step':>10}{'GB/s':>9}"
                f"{'of read':>10}")


def print_limit(bandwidth: dict[str, float], rows: dict[str, tuple[float, int, int]]) -> None:
    """The batch-1 step against this machine's memory bandwidth (stream_bandwidth), per
    variant: (ms/step, weight bytes, K/V bytes)."""
    print(f"\nbatch-1 decode against the memory bandwidth (STREAM-style, same threads: copy "
          f"{bandwidth['copy']:.1f}, triad {bandwidth['triad']:.1f}, read "
          f"{bandwidth['read']:.1f} GB/s); a step reads its weights (top-k experts) and K/V. "
          "Weights that fit the last-level cache (attention, lm_head) may stay there between "
          "steps: a share past 100% says so")
    print(LIMIT_HEADER)
    for name, (ms, weights, kv) in rows.items():
        print(limit_line(name, ms, weights, kv, bandwidth["read"]))
