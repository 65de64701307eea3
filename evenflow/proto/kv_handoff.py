"""The prefill -> decode KV hand-off: the one place its byte layout is stated, split into chunks,
reassembled and checked. Torch-free: the engine turns its tensors into a `KVPayload` and back.

Layout. A request's prompt K/V is `num_blocks` blocks (ceil(prompt tokens / block size)),
block-major and C-contiguous:

    (num_blocks, num_layers, 2 [K, V], block_size, num_kv_heads, head_dim)   in `dtype`

or, for multi-head latent attention (DeepSeek-V2 / -V3), one part per layer, the latent:

    (num_blocks, num_layers, 1, block_size, 1, kv_lora_rank + qk_rope_head_dim)

or, for an int8 cache (kv_cache_dtype="int8"), each (layer, K or V) of a block is its int8
values followed by its float32 scale per KV head, as bytes:

    (num_blocks, num_layers, 2, block_size * num_kv_heads * head_dim + 4 * num_kv_heads)  int8

`block_shape` is everything after num_blocks; `dtype` is torch's name without "torch."
("bfloat16", "float32", "float16"; "uint8" for the mock engine, whose block shape is (0,)), in
the machine's byte order (little-endian on every platform we run). Block b occupies bytes
[b * block_bytes, (b + 1) * block_bytes). The last block's slots past the prompt hold whatever
the cache held; the receiver never reads them.

On the wire. Chunks (`KVBlockChunk`) carry whole blocks, at most `max_bytes` each (at least one
block), numbered 0, 1, 2, ... in order; then `KVTransferComplete` says how many chunks, blocks
and which dtype. The receiver fails the request on a repeated, missing or out-of-order chunk
and on a byte count that does not match blocks x block bytes; it never guesses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1, "int8": 1}


class KVHandoffError(ValueError):
    """The K/V received cannot be used (the request fails; a retry may succeed)."""


@dataclass(frozen=True)
class KVPayload:
    """One request's prompt K/V in the layout above; `data` is its bytes (a view on send)."""

    data: memoryview | bytes | bytearray
    dtype: str
    num_blocks: int
    block_shape: tuple[int, ...]
    # speculative decoding's mtp: the final hidden states of the prompt's last positions (rows
    # of the model's hidden size, in hidden_dtype), so the decode side's next-token layer
    # starts with that much of the prompt's context; empty otherwise
    hidden: memoryview | bytes = b""
    hidden_dtype: str = ""

    def __post_init__(self) -> None:
        if self.dtype not in ITEMSIZE:
            raise KVHandoffError(f"K/V dtype {self.dtype!r} is not one of {sorted(ITEMSIZE)}")
        if len(self.hidden) and self.hidden_dtype not in ITEMSIZE:
            raise KVHandoffError(f"hidden-state dtype {self.hidden_dtype!r} is not one of "
                                 f"{sorted(ITEMSIZE)}")
        expected = self.num_blocks * self.block_bytes
        if len(memoryview(self.data).cast("B")) != expected:
            raise KVHandoffError(f"K/V of {len(memoryview(self.data).cast('B'))} bytes is not "
                                 f"{self.num_blocks} blocks of {self.block_bytes}")

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * ITEMSIZE[self.dtype]

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_blocks, *self.block_shape)


@dataclass(frozen=True)
class Chunk:
    seq: int
    first_block: int
    num_blocks: int
    data: memoryview


def split(payload: KVPayload, max_bytes: int) -> list[Chunk]:
    """Whole blocks, at most max_bytes per chunk (at least one block): views, no copy."""
    raw = memoryview(payload.data).cast("B")
    per_block = payload.block_bytes
    step = max(1, max_bytes // per_block) if per_block else max(1, payload.num_blocks)
    return [Chunk(seq, first, min(step, payload.num_blocks - first),
                  raw[first * per_block : (first + step) * per_block])
            for seq, first in enumerate(range(0, payload.num_blocks, step))]


@dataclass
class Assembler:
    """Collects one request's chunks in order; `finish` checks them and returns the payload."""

    chunks: list[bytes] = field(default_factory=list)
    next_block: int = 0
    broken: str | None = None  # why the transfer failed, once it has

    @property
    def num_bytes(self) -> int:
        return sum(map(len, self.chunks))

    def add(self, seq: int, first_block: int, num_blocks: int, data: bytes) -> None:
        """One chunk; a repeated, missing or misplaced one breaks the transfer for good."""
        if self.broken:
            return
        if seq != len(self.chunks) or first_block != self.next_block:
            kind = "duplicated" if seq < len(self.chunks) else "missing"
            self.broken = (f"KV chunk {seq} (block {first_block}) arrived when "
                           f"{len(self.chunks)} (block {self.next_block}) was expected "
                           f"({kind} chunk)")
            self.chunks.clear()
            return
        self.chunks.append(data)
        self.next_block += num_blocks

    def finish(self, num_chunks: int, num_blocks: int, dtype: str,
               block_shape: tuple[int, ...]) -> KVPayload:
        """The whole payload, copied once into one writable buffer; raises KVHandoffError."""
        if self.broken:
            raise KVHandoffError(self.broken)
        if len(self.chunks) != num_chunks:
            raise KVHandoffError(f"{len(self.chunks)} of {num_chunks} KV chunks arrived")
        buffer = bytearray(self.num_bytes)
        offset = 0
        for data in self.chunks:
            buffer[offset : offset + len(data)] = data
            offset += len(data)
        return KVPayload(buffer, dtype, num_blocks, block_shape)
