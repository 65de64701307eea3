"""The paged KV cache's form, decided once (`KVCacheSpec`): what each layer stores per token
(K and V per KV head, or MLA's one latent), in which dtype (the model's, or int8 with a
float32 scale per (block, head): engine/model/kv_quant.py), the bytes a block takes, the
tensors it is allocated as, the shape a block takes on the wire and in the disk tier, and
whether the native kernels serve it. The engine sizes the cache from it, the runner allocates
from it, and everything after reads it instead of asking the first cache tensor or the
`kv_cache_dtype` string again.

`SlidingLayers`: a model whose layers slide over one window shorter than its context (GPT-OSS's
every other layer; Mistral's and Qwen2's windowed checkpoints, every layer) keeps those layers'
K/V in a pool of its own, with a block table of its own that holds only the window
(core/window_blocks.py); the other layers' pool, the one the prefix cache and the KV index
count, gets the memory they no longer take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from evenflow.engine.config.settings import ModelConfig, check_kv_cache_dtype
from evenflow.engine.kernels import native


@dataclass(frozen=True)
class SlidingLayers:
    """The layers that read only the last `window` tokens, when they share one window shorter
    than the context (MLA never slides)."""

    window: int
    layers: tuple[int, ...]

    @classmethod
    def of(cls, cfg: ModelConfig, max_model_len: int) -> SlidingLayers | None:
        windows = {i: cfg.window(i) for i in range(cfg.num_layers)}
        layers = tuple(i for i, w in windows.items() if 0 < w < max_model_len)
        if cfg.mla or not layers or len({windows[i] for i in layers}) > 1:
            return None
        return cls(windows[layers[0]], layers)

    def pool_blocks(self, max_num_seqs: int, max_num_batched_tokens: int,
                    block_size: int) -> int:
        """Blocks the sliding layers' pool needs so that it never runs out before the other
        pool: each running sequence's window and the block its next token opens, and one
        step's chunks of new tokens."""
        per_seq = -(-self.window // block_size) + 3
        return max_num_seqs * per_seq + -(-max_num_batched_tokens // block_size)


def pool_sizes(spec: KVCacheSpec, sliding: SlidingLayers | None, *, budget_bytes: int,
               num_blocks: int, wanted: int, max_num_seqs: int, max_num_batched_tokens: int
               ) -> tuple[int, int]:
    """(blocks of the full layers' pool, of the sliding layers' own pool: 0 without one).
    `num_blocks` (configured, else 0) fixes the first; else as many as `budget_bytes` holds
    once the sliding pool is paid for, at most `wanted` (every sequence's whole context). A
    model whose every layer slides keeps its first pool as bookkeeping only (no layer stores
    in it: `wanted` blocks, no bytes). The sliding pool never holds more blocks than the other
    (no sequence needs more there), nor more than one table for every layer would have."""
    per_layer = spec.bytes_per_layer_block
    shared = num_blocks or max(1, min(wanted, budget_bytes // (per_layer * spec.layers)))
    if sliding is None:
        return shared, 0
    # at most what one table for every layer would hold: the full layers' pool never gets less
    window = min(shared, sliding.pool_blocks(max_num_seqs, max_num_batched_tokens,
                                             spec.block_size))
    slides, full_layers = len(sliding.layers), spec.layers - len(sliding.layers)
    if num_blocks or not full_layers:
        full = num_blocks or wanted
    else:
        left = budget_bytes - window * per_layer * slides
        full = max(1, min(wanted, left // (per_layer * full_layers)))
    return full, window


@dataclass(frozen=True)
class KVCacheSpec:
    """One rank's paged KV cache: `layers` layers of `parts` ((heads, dims) a token: K and V,
    or MLA's latent), blocks of `block_size` tokens, values of `dtype` (the model's `compute`
    dtype, or int8: then each part has its float32 scales, (blocks + 1, heads))."""

    layers: int
    parts: tuple[tuple[int, int], ...]
    block_size: int
    dtype: torch.dtype
    compute: torch.dtype

    @classmethod
    def of(cls, cfg: ModelConfig, block_size: int, compute: torch.dtype, kv_cache_dtype: str,
           kv_heads: int | None = None) -> KVCacheSpec:
        """The cache of this model (this rank's `kv_heads` KV heads; default all of them) under
        EngineConfig.kv_cache_dtype."""
        check_kv_cache_dtype(kv_cache_dtype)
        return cls(cfg.num_layers, cfg.kv_parts(kv_heads), block_size,
                   torch.int8 if kv_cache_dtype == "int8" else compute, compute)

    @property
    def quantized(self) -> bool:
        """int8 values with per-(block, head) float32 scales."""
        return self.dtype == torch.int8

    @property
    def num_parts(self) -> int:
        """A layer's value tensors: K and V (2), or MLA's latent (1); scales not counted."""
        return len(self.parts)

    @property
    def name(self) -> str:
        """The values' dtype as the wire and the heartbeats name it (bfloat16, int8, ...)."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes over every layer: values, and an int8 cache's scales."""
        values = self.block_size * sum(h * d for h, d in self.parts) * self.dtype.itemsize
        scales = 4 * sum(h for h, _ in self.parts) if self.quantized else 0
        return self.layers * (values + scales)

    @property
    def bytes_per_layer_block(self) -> int:
        return self.bytes_per_block // self.layers

    def allocate(self, num_blocks: int, sliding: SlidingLayers | None = None,
                 window_blocks: int = 0) -> list[tuple[Tensor, ...]]:
        """Per layer its parts, (num_blocks * block_size + 1, heads, dims) each, then (int8)
        their scales, (num_blocks + 1, heads) float32 each. torch.empty: pages are only touched
        (and counted in RSS) as blocks are used. The extra last slot stays zero: padded
        attention positions read it, never uninitialised memory (0 * NaN would poison a row);
        the null slot's block scales by 0. `sliding`'s layers get `window_blocks` + 1 blocks
        instead, the last one zero too: their null block, which a window table's given-back
        entries point to."""
        caches: list[tuple[Tensor, ...]] = []
        for layer in range(self.layers):
            blocks, zeroed = num_blocks, 0
            if sliding is not None and layer in sliding.layers:
                blocks, zeroed = window_blocks + 1, self.block_size
            slots = blocks * self.block_size
            parts = tuple(torch.empty(slots + 1, heads, dims, dtype=self.dtype)
                          for heads, dims in self.parts)
            for part in parts:
                part[slots - zeroed :].zero_()
            if self.quantized:
                parts += tuple(torch.zeros(blocks + 1, heads) for heads, _ in self.parts)
            caches.append(parts)
        return caches

    def transfer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """A run of blocks as the hand-off and the disk tier carry it (engine/runners/
        model_runner.py read_kv): (blocks, layers, parts, block_size, heads, dims) of `dtype`,
        or for int8 (blocks, layers, parts, bytes): each part's values, then its scales."""
        heads, dims = self.parts[0]
        if self.quantized:
            return (num_blocks, self.layers, self.num_parts,
                    self.block_size * heads * dims + 4 * heads)
        return (num_blocks, self.layers, self.num_parts, self.block_size, heads, dims)

    def kernels_serve(self) -> bool:
        """Whether the native kernels read and write this cache (an int8 cache needs the
        kv_int8 kernels: else torch's dequantizing gather serves it)."""
        return not self.quantized or native.kv_int8() is not None
