"""The engine's side of the KV disk tier (engine/runners/disk_tier.py): after each schedule,
the cached blocks it evicted are copied down to disk before their memory is reused, and the
blocks it promoted are filled from disk before the forward pass; the disk tier's own stores
and evictions become KV events naming their medium ("disk", as vLLM's events do)."""

from __future__ import annotations

import time
from pathlib import Path

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
        block_bytes = int(torch.Size(self.block_shape).numel()) * \
            runner.kv_caches[0][0].element_size()
        self.disk = DiskTier(directory, int(capacity_gb * 2**30), block_bytes, {
            **model_fingerprint(model_dir), "kv_dtype": str(runner.kv_caches[0][0].dtype),
            "block_size": runner.block_size, "salt": salt.hex()})
        blocks.lower_tier = self.disk
        self.saved = self.promoted = 0
        self.save_s = self.promote_s = 0.0  # time spent copying, for bench and metrics

    def after_schedule(self) -> None:
        """Copy the evicted blocks down, then fill the promoted ones (in that order: a block
        may be both, its old content saved before the promoted one lands)."""
        saves = self.blocks.take_saves()
        if saves:
            t0 = time.perf_counter()
            data = self.runner.read_kv([b for b, _ in saves]).contiguous()
            raw = data.view(torch.uint8).view(len(saves), -1).numpy()
            stored, removed = [], []
            for row, (_, h) in enumerate(saves):
                evicted = self.disk.put(h, raw[row].data)
                stored.append(h)
                if evicted is not None:
                    removed.append(evicted)
            if removed:
                self.blocks.pending_events.append(BlockRemoved(block_hashes=removed,
                                                               medium=DISK))
            self.blocks.pending_events.append(BlockStored(block_hashes=stored, medium=DISK))
            self.saved += len(saves)
            self.save_s += time.perf_counter() - t0
        promotions = self.blocks.take_promotions()
        if promotions:
            t0 = time.perf_counter()
            dtype = self.runner.kv_caches[0][0].dtype
            payload = b"".join(self.disk.get(h) for _, h in promotions)
            kv = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(
                len(promotions), *self.block_shape[1:])
            self.runner.write_kv([b for b, _ in promotions], kv)
            self.promoted += len(promotions)
            self.promote_s += time.perf_counter() - t0

    def hashes(self) -> list[int]:
        """Every block hash the disk tier holds, for a KV-index resync."""
        return self.disk.hashes()

    def close(self) -> None:
        self.disk.close()
