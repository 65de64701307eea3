"""The KV cache's second tier: whole blocks evicted from RAM kept on local disk, in one
preallocated pool file of fixed slots under a byte cap, least recently used out first; a later
prefix hit promotes a block back into RAM instead of recomputing it.

Layout of `<dir>/pool.bin`: slots of SLOT_HEADER + block_bytes. A slot's header is a magic
number and the block hash it holds (0: empty); the block's bytes are the hand-off's layout of
one block (engine/runners/model_runner.py read_kv: every layer's K and V, and an int8 cache's
scales), so any block format the engine has goes through unchanged. The payload is written
before the header, so a worker killed mid-write leaves at worst an empty slot.

`<dir>/tier.json` names what the blocks were computed with: the model (its config and weight
files' names and sizes), the cache's dtype, block size, bytes per block and the hash salt. A
worker restarted on the same directory with the same fingerprint keeps the tier warm (its index
is rebuilt from the slot headers); any difference wipes it, saying so once in the log.

The pool is an mmap: writes land in the page cache and the kernel writes them back; a
promotion reads from the page cache when the block is still there, else from disk.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

SLOT_HEADER = 16  # magic (u64), block hash (u64)
MAGIC = 0x4556_4B56_5449_4552  # "EVKVTIER"
POOL, MANIFEST = "pool.bin", "tier.json"


def model_fingerprint(model_dir: Path) -> dict[str, Any]:
    """The checkpoint as the tier needs to recognise it: config.json's text and every weight
    file's name and size."""
    config = (model_dir / "config.json").read_text() if (model_dir / "config.json").exists() \
        else ""
    weights = sorted((p.name, p.stat().st_size) for p in model_dir.iterdir()
                     if p.suffix in (".safetensors", ".bin", ".gguf"))
    return {"config": config, "weights": weights}


class DiskTier:
    """Block hash -> one block's bytes, at most `capacity` blocks, LRU."""

    def __init__(self, directory: str | Path, capacity_bytes: int, block_bytes: int,
                 fingerprint: dict[str, Any]) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.block_bytes = block_bytes
        self.slot_bytes = SLOT_HEADER + block_bytes
        self.capacity = max(1, capacity_bytes // self.slot_bytes)
        # (as JSON gives it back: tuples become lists)
        self.fingerprint = json.loads(json.dumps(
            {**fingerprint, "block_bytes": block_bytes, "slots": self.capacity}))
        self.index: OrderedDict[int, int] = OrderedDict()  # hash -> slot, least recent first
        self.free_slots: list[int] = []
        self.warm_blocks = 0  # blocks found from an earlier run at start
        self.wiped_reason = ""  # why an earlier run's tier was wiped ("" if not)
        self._open()

    # -- start ------------------------------------------------------------------------------
    def _open(self) -> None:
        manifest, pool = self.dir / MANIFEST, self.dir / POOL
        size = self.capacity * self.slot_bytes
        keep = False
        if manifest.exists() and pool.exists():
            try:
                previous = json.loads(manifest.read_text())
            except ValueError:
                previous = None
            keep = previous == self.fingerprint and pool.stat().st_size == size
            if not keep:
                self.wiped_reason = "its model, KV dtype or size differs" if previous else \
                    "its manifest is unreadable"
                log.warning("KV disk tier at %s: wiped, %s", self.dir, self.wiped_reason)
        if not keep:
            pool.unlink(missing_ok=True)
            manifest.unlink(missing_ok=True)
            with open(pool, "wb") as f:
                f.truncate(size)  # sparse: disk is only used as slots fill
            manifest.write_text(json.dumps(self.fingerprint))
        self._file = open(pool, "r+b")  # noqa: SIM115 (held for the mmap's life)
        self._map = mmap.mmap(self._file.fileno(), size)
        for slot in range(self.capacity):
            magic, block_hash = struct.unpack_from("<QQ", self._map, slot * self.slot_bytes)
            if keep and magic == MAGIC and block_hash not in self.index:
                self.index[block_hash] = slot
            else:
                self.free_slots.append(slot)
        self.warm_blocks = len(self.index)
        if self.warm_blocks:
            log.info("KV disk tier at %s: %d blocks kept from an earlier run", self.dir,
                     self.warm_blocks)
        self.free_slots.reverse()  # pop() hands out slot 0 first

    # -- use --------------------------------------------------------------------------------
    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self.index

    def __len__(self) -> int:
        return len(self.index)

    def hashes(self) -> list[int]:
        return list(self.index)

    def put(self, block_hash: int, data: memoryview | bytes) -> int | None:
        """Store one block (touching it if present); -> the hash it evicted, if any."""
        if block_hash in self.index:
            self.index.move_to_end(block_hash)
            return None
        assert len(data) == self.block_bytes, "a block of another layout"
        evicted = None
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            evicted, slot = self.index.popitem(last=False)
        base = slot * self.slot_bytes
        struct.pack_into("<QQ", self._map, base, 0, 0)  # empty while the payload is written
        self._map[base + SLOT_HEADER : base + self.slot_bytes] = data
        struct.pack_into("<QQ", self._map, base, MAGIC, block_hash)
        self.index[block_hash] = slot
        return evicted

    def touch(self, block_hash: int) -> None:
        """A held block was used: the last to leave."""
        self.index.move_to_end(block_hash)

    def get(self, block_hash: int) -> bytes:
        """One block's bytes."""
        slot = self.index[block_hash]
        self.index.move_to_end(block_hash)
        base = slot * self.slot_bytes + SLOT_HEADER
        return self._map[base : base + self.block_bytes]

    def close(self) -> None:
        if not self._map.closed:
            self._map.flush()
            self._map.close()
            self._file.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # (interpreter shutdown)
            pass


def remove_tier(directory: str | Path) -> None:
    """Delete a tier's files (a non-persistent tier at a clean exit)."""
    for name in (POOL, MANIFEST):
        (Path(directory) / name).unlink(missing_ok=True)
    try:
        os.rmdir(directory)
    except OSError:
        pass
