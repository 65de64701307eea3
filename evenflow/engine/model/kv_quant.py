"""The int8 KV cache (kv_cache_dtype="int8"): what it stores, how new K/V is written into it and
how attention reads it back.

Storage, per layer: K and V as int8 (slots + 1, kv_heads, head_dim), like the model-dtype cache,
and one float32 scale per (block, KV head) for each, (blocks + 1, kv_heads): slot s of head g
holds x ~= q * scale[s // block_size, g]. A block's scale only grows while the block fills; a
write that grows it requantizes the block's earlier values once (kernels/kv_quant.cpp states
the rule; `write_quantized_torch` here is the same rule in torch and the tests' reference).
Half the bytes of bf16 plus 4 bytes per (block, head): 1.99x the blocks in the same
kv_cache_gb at block size 16 and head dim 64.

Why per block and not per token: a per-token scale costs 4 bytes per 64 values (1.88x the
blocks, not 2x), and per-block scales are what a block-granular tier (the hand-off, the prefix
cache, the disk tier) moves anyway: a block and its scales travel together.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

QMAX = 127


def block_size_of(cache: Tensor, scales: Tensor) -> int:
    """The cache's block size: (blocks * block_size + 1) slots over (blocks + 1) scale rows."""
    return (cache.shape[0] - 1) // max(1, scales.shape[0] - 1)


def write_quantized(x: Tensor, cache: Tensor, scales: Tensor, slots: Tensor,
                    kernels: Any = None) -> None:
    """New values x (T, kv_heads, hd) into their slots (T,) of an int8 cache and its scales:
    through `kernels` (native.kv_int8(), as the layer's runner chose it) where given."""
    block_size = block_size_of(cache, scales)
    if kernels is not None and x.dtype in (torch.float32, torch.bfloat16):
        kernels.kv_write_int8(x.contiguous(), cache, scales, slots, block_size)
        return
    write_quantized_torch(x, cache, scales, slots, block_size)


def write_quantized_torch(x: Tensor, cache: Tensor, scales: Tensor, slots: Tensor,
                          block_size: int) -> None:
    """kernels/kv_quant.cpp's rule in torch: per run of tokens in one block, per head."""
    x = x.float()
    n_kv = x.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    unique, inverse, counts = torch.unique_consecutive(blocks, return_inverse=True,
                                                       return_counts=True)
    first_offset = offsets[counts.cumsum(0) - counts]  # (U,)
    amax = torch.zeros(len(unique), n_kv).scatter_reduce_(
        0, inverse.unsqueeze(1).expand(-1, n_kv), x.abs().amax(-1), "amax")
    old = torch.where((first_offset == 0).unsqueeze(1), 0.0, scales[unique])
    fresh = torch.maximum(old, amax / QMAX)
    grown = (fresh > old) & (old > 0)
    if bool(grown.any()):  # the grown blocks' earlier values, to the new scale
        ratio = torch.where(grown, old / fresh, 1.0)  # (U, n_kv)
        rows = torch.arange(block_size)
        earlier = rows < first_offset.unsqueeze(1)  # (U, block_size)
        which = earlier.nonzero()  # (N, 2): (run, offset)
        earlier_slots = unique[which[:, 0]] * block_size + which[:, 1]
        values = cache.index_select(0, earlier_slots).float() * \
            ratio[which[:, 0]].unsqueeze(-1)
        cache.index_copy_(0, earlier_slots, values.round().to(torch.int8))
    scales[unique] = fresh
    per_token = fresh[inverse].unsqueeze(-1)  # (T, n_kv, 1)
    q = torch.where(per_token > 0, (x / per_token).round().clamp(-QMAX, QMAX), 0.0)
    cache.index_copy_(0, slots, q.to(torch.int8))


def gather_dequantized(cache: Tensor, scales: Tensor, slots: Tensor, dtype: torch.dtype
                       ) -> Tensor:
    """The values at slots (any shape) -> (*slots.shape, kv_heads, hd) in dtype."""
    block_size = block_size_of(cache, scales)
    flat = slots.reshape(-1)
    values = cache.index_select(0, flat).float() * \
        scales.index_select(0, flat // block_size).unsqueeze(-1)
    return values.to(dtype).view(*slots.shape, *cache.shape[1:])


def paged_decode_attention_int8(kernels: Any, q: Tensor, k_cache: Tensor, v_cache: Tensor,
                                k_scales: Tensor, v_scales: Tensor, slots: Tensor, lens: Tensor,
                                scale: float, sinks: Tensor | None = None) -> Tensor:
    """The paged decode kernel over the int8 cache (kernels/paged_attention.cpp), from the
    kernels the layer's runner chose (native.kv_int8())."""
    assert kernels is not None, "the runner picks the paged path only with the kernels built"
    return kernels.paged_decode_attention_int8(  # type: ignore[no-any-return]
        q, k_cache, v_cache, k_scales, v_scales, slots, lens, scale,
        block_size_of(k_cache, k_scales), sinks)
