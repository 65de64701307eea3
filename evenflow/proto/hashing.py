"""Chained KV-block hashing: THE one definition shared by the engine, the gateway and the KV index.

A block's hash covers its parent's hash, its token ids and a namespace salt (the model, so two
models never share ids). Hashes are unsigned 64-bit integers, which msgpack and Redis carry as-is.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_PARENT = 0  # the parent hash of a sequence's first block


def block_hash(parent: int, token_ids: Sequence[int], salt: bytes = b"") -> int:
    """Hash of one full block: blake2b-64 over (salt, parent hash, token ids as uint32)."""
    h = hashlib.blake2b(digest_size=8, person=salt[:16])
    h.update(parent.to_bytes(8, "little"))
    h.update(array("I", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def chain_hashes(
    token_ids: Sequence[int], block_size: int, salt: bytes = b"", parent: int = ROOT_PARENT
) -> list[int]:
    """Hashes of every *full* block of `token_ids`, each chained to the one before."""
    assert block_size > 0
    # Same bytes as block_hash, block by block, with the token ids converted once and each
    # block's hasher copied from one keyed state (half the cost of constructing it).
    step = block_size * 4
    data = memoryview(array("I", token_ids[: len(token_ids) // block_size * block_size]).tobytes())
    base = hashlib.blake2b(digest_size=8, person=salt[:16])
    previous = parent.to_bytes(8, "little")
    hashes: list[int] = []
    for start in range(0, len(data), step):
        h = base.copy()
        h.update(previous)
        h.update(data[start : start + step])
        previous = h.digest()
        hashes.append(int.from_bytes(previous, "little"))
    return hashes


def namespace_salt(model_name: str) -> bytes:
    """The salt for a model: 16 bytes derived from its name, so ids never collide across models."""
    return hashlib.blake2b(model_name.encode(), digest_size=16).digest()


def adapter_salt(model_salt: bytes, adapter: str) -> bytes:
    """The salt of a LoRA adapter's requests on a model: their K/V differs from the base
    model's, so their blocks' ids must too (the engine, the gateway and the KV index agree)."""
    return hashlib.blake2b(adapter.encode(), digest_size=16, key=model_salt[:16]).digest()
