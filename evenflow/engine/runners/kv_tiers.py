"""The engine's side of the KV disk tier (engine/runners/disk_tier.py): after each schedule,
the cached blocks it evicted are copied down to disk before their memory is reused, and the
blocks it promoted are filled from disk before the forward pass; the disk tier's own stores
and evictions become KV events naming their medium ("disk", as vLLM's events do), in the order
they happened, and are counted in the block manager's `tier_counts`."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from evenflow.engine.core.block_manager import BlockManager
from evenflow.engine.runners.disk_tier import DiskTier, model_fingerprint
from evenflow.engine.runners.model_runner import ModelRunner
from evenflow.proto.messages import DISK_MEDIUM as DISK
from evenflow.proto.messages import BlockRemoved, BlockStored


class KVTiers:
    def __init__(self, runner: ModelRunner, blocks: BlockManager, directory: str,
                 capacity_gb: float, model_dir: Path, salt: bytes) -> None:
        self.runner, self.blocks = runner, blocks
        self.block_shape = runner.kv_shape(1)
        block_bytes = int(torch.Size(self.block_shape).numel()) * runner.kv_spec.dtype.itemsize
        self.disk = DiskTier(directory, int(capacity_gb * 2**30), block_bytes, {
            **model_fingerprint(model_dir), "kv_dtype": str(runner.kv_spec.dtype),
            "block_size": runner.block_size, "salt": salt.hex()})
        blocks.lower_tier = self.disk
        self.counts = blocks.tier_counts
        self.save_s = self.promote_s = 0.0  # time spent copying, for bench and metrics

    @property
    def saved(self) -> int:
        return self.counts.writes

    @property
    def promoted(self) -> int:
        return self.counts.promotions

    def after_schedule(self) -> None:
        """Copy the evicted blocks down and fill the promoted ones. In this order: the evicted
        blocks are read out of RAM (a block may be both, its old content saved before the
        promoted one lands); the promoted ones' bytes are taken, from disk or, for a block
        evicted in this same schedule, from its copy in hand (before the writes, which may push
        the tier's oldest blocks out, promoted ones among them); the copies are written; the
        promoted blocks are filled."""
        saves, promotions = self.blocks.take_saves(), self.blocks.take_promotions()
        if not saves and not promotions:
            return
        t0 = time.perf_counter()
        new = [(b, h) for b, h in saves if h not in self.disk]
        for _, h in saves:  # already down: used until now, so the last to leave the tier
            if h in self.disk:
                self.disk.touch(h)
        raw = self.runner.read_kv([b for b, _ in new]).contiguous().view(torch.uint8).view(
            len(new), -1).numpy() if new else None
        t1 = time.perf_counter()
        row_of = {h: row for row, (_, h) in enumerate(new)}
        payload = []
        for _, h in promotions:
            if h in row_of:
                assert raw is not None
                payload.append(raw[row_of[h]].tobytes())
            else:
                payload.append(self.disk.get(h))
        t2 = time.perf_counter()
        if new:
            assert raw is not None
            self._write(new, raw)
        t3 = time.perf_counter()
        if promotions:
            dtype = self.runner.kv_spec.dtype
            kv = torch.frombuffer(bytearray(b"".join(payload)), dtype=torch.uint8).view(
                dtype).view(len(promotions), *self.block_shape[1:])
            self.runner.write_kv([b for b, _ in promotions], kv)
            self.counts.promotions += len(promotions)
        self.save_s += (t1 - t0) + (t3 - t2)
        self.promote_s += (t2 - t1) + (time.perf_counter() - t3)

    def _write(self, new: list[tuple[int, int]], raw: np.ndarray) -> None:
        """The evicted blocks' copies (rows of raw) to disk, and their events: what the tier
        dropped for them first, then what it stored (a block stored and dropped within the
        batch is in neither)."""
        stored: dict[int, None] = {}
        removed: list[int] = []
        for row, (_, h) in enumerate(new):
            evicted = self.disk.put(h, raw[row].data)
            stored[h] = None
            if evicted is not None:
                if evicted in stored:
                    del stored[evicted]
                else:
                    removed.append(evicted)
                self.blocks.note_dropped([evicted])
        self.counts.writes += len(new)
        if removed:
            self.blocks.pending_events.append(BlockRemoved(block_hashes=removed, medium=DISK))
        if stored:
            self.blocks.pending_events.append(BlockStored(block_hashes=list(stored),
                                                          medium=DISK))

    def hashes(self) -> list[int]:
        """Every block hash the disk tier holds, for a KV-index resync."""
        return self.disk.hashes()

    def close(self) -> None:
        self.disk.close()
