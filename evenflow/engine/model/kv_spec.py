"""The paged KV cache's form, decided once (`KVCacheSpec`): what each layer stores per token
(K and V per KV head, or MLA's one latent), in which dtype (the model's, or int8 with a
float32 scale per (block, head): engine/model/kv_quant.py), the bytes a block takes, the
tensors it is allocated as, the shape a block takes on the wire and in the disk tier, and
whether the native kernels serve it. The engine sizes the cache from it, the runner allocates
from it, and everything after reads it instead of asking the first cache tensor or the
`kv_cache_dtype` string again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from evenflow.engine.config.settings import ModelConfig, check_kv_cache_dtype
from evenflow.engine.kernels import native


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

    def allocate(self, num_blocks: int) -> list[tuple[Tensor, ...]]:
        """Per layer its parts, (num_blocks * block_size + 1, heads, dims) each, then (int8)
        their scales, (num_blocks + 1, heads) float32 each. torch.empty: pages are only touched
        (and counted in RSS) as blocks are used. The extra last slot stays zero: padded
        attention positions read it, never uninitialised memory (0 * NaN would poison a row);
        the null slot's block scales by 0."""
        slots = num_blocks * self.block_size
        caches: list[tuple[Tensor, ...]] = []
        for _ in range(self.layers):
            parts = tuple(torch.empty(slots + 1, heads, dims, dtype=self.dtype)
                          for heads, dims in self.parts)
            for part in parts:
                part[slots].zero_()
            if self.quantized:
                parts += tuple(torch.zeros(num_blocks + 1, heads) for heads, _ in self.parts)
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
