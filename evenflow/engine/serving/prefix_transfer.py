"""The engine's prefix cache as a worker sees it (a part Engine holds, `engine.prefix`): its
block events for the KV index, its hashes for a resync, and the two sides of KV pulls - a
prompt's leading blocks that this engine holds (in RAM or on its disk tier), read out in the
hand-off layout for another worker (`export_prefix`), and blocks pulled from another worker put
into this prefix cache (`import_prefix`), so the request that follows finds them as prefix hits
and computes only the rest. All run on the engine thread, between steps; `cached_prefix_blocks`
and `disk_counts` are reads the event loop may make (a step stale at most)."""

from __future__ import annotations

from typing import Any

import torch

from evenflow.engine.core.block_manager import BlockManager, TierCounts
from evenflow.engine.runners.kv_tiers import KVTiers
from evenflow.proto.hashing import chain_hashes
from evenflow.proto.kv_handoff import KVHandoffError, KVPayload
from evenflow.proto.messages import KVCacheEvent


class PrefixCache:
    def __init__(self, blocks: BlockManager, runner: Any, tiers: KVTiers | None,
                 kv_dtype: torch.dtype, collect_events: bool = False) -> None:
        # (all fixed for the engine's life: a kernel switch re-attaches the model to the same
        # runner); runner: the model's, a TP leader's or the mock's (read_kv, write_kv, kv_shape)
        self.blocks, self.runner, self.tiers, self.kv_dtype = blocks, runner, tiers, kv_dtype
        self.kv_dtype_name = str(kv_dtype).removeprefix("torch.")
        # Without a KV event listener, a serving engine keeps its cache's events here for
        # take_kv_events()
        self.collect_events = collect_events
        self._events: list[KVCacheEvent] = []

    def keep_events(self, events: list[KVCacheEvent]) -> None:
        """A step's cache events, kept for take_kv_events (collecting engines)."""
        if self.collect_events:
            self._events.extend(events)

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The cache's changes since the last call (collecting engines)."""
        events, self._events = self._events, []
        return events

    def cached_block_hashes(self) -> list[int]:
        """Every block hash the prefix cache holds, for a KV-index resync."""
        return self.blocks.cached_hashes()

    def disk_block_hashes(self) -> list[int]:
        """Every block hash the disk tier holds (none without one), for a KV-index resync."""
        return self.tiers.hashes() if self.tiers is not None else []

    @property
    def disk_counts(self) -> TierCounts | None:
        """The disk tier's counts so far (None without one); a read the event loop may make."""
        return self.blocks.tier_counts if self.tiers is not None else None

    def _prefix_hashes(self, token_ids: list[int]) -> list[int]:
        """Chained hashes of the prompt's full blocks that a prefill may take from a cache
        (the last token is always computed: a block holding it never counts)."""
        bs = self.blocks.block_size
        usable = max(0, len(token_ids) - 1) // bs * bs
        return chain_hashes(token_ids[:usable], bs, self.blocks.salt)

    def cached_prefix_blocks(self, token_ids: list[int]) -> int:
        """How many of the prompt's leading blocks this RAM cache holds (loop-safe read)."""
        return len(self.blocks.cached_run(self._prefix_hashes(token_ids), 0))

    def export_prefix(self, token_ids: list[int], first_block: int) -> KVPayload:
        """The K/V of the full blocks of `token_ids` from first_block on, as far as this engine
        holds them without a gap, in RAM or on its disk tier (possibly none), in the hand-off
        layout."""
        if first_block < 0:
            raise ValueError(f"first block {first_block} is negative")
        # (every full block of what the asker sent: it cut the prompt to the blocks it wants)
        bs = self.blocks.block_size
        whole = token_ids[: len(token_ids) // bs * bs]
        hashes = chain_hashes(whole, bs, self.blocks.salt)[first_block:]
        disk = self.tiers.disk if self.tiers is not None else None
        held: list[tuple[int, int]] = []  # (RAM block or -1 for the disk tier, hash)
        for h in hashes:
            block = self.blocks.cached.get(h, -1)
            if block < 0 and (disk is None or h not in disk):
                break
            held.append((block, h))
        shape = tuple(self.runner.kv_shape(1)[1:])
        if not held:
            return KVPayload(b"", self.kv_dtype_name, 0, shape)
        in_ram = [b for b, _ in held if b >= 0]
        self.blocks.tier_counts.hits += len(held) - len(in_ram)  # (read from the disk tier)
        if len(in_ram) == len(held):  # (the usual case: one read, no copy)
            kv = self.runner.read_kv(in_ram).contiguous()
            raw = memoryview(kv.view(torch.uint8).numpy().reshape(-1).data)
            return KVPayload(raw, self.kv_dtype_name, len(held), shape)
        from_ram = self.runner.read_kv(in_ram).contiguous().view(torch.uint8).view(
            len(in_ram), -1).numpy() if in_ram else None
        parts, next_ram = [], 0
        for block, h in held:
            if block >= 0:
                assert from_ram is not None
                parts.append(from_ram[next_ram].tobytes())
                next_ram += 1
            else:
                assert disk is not None
                parts.append(disk.get(h))
        return KVPayload(b"".join(parts), self.kv_dtype_name, len(held), shape)

    def import_prefix(self, token_ids: list[int], first_block: int, kv: KVPayload) -> int:
        """Blocks first_block .. first_block + kv.num_blocks - 1 of the prompt, pulled from
        another worker, into the prefix cache (cached, no user); how many were written. Raises
        KVHandoffError when the K/V does not fit this engine's layout."""
        if first_block < 0:
            raise KVHandoffError(f"first block {first_block} is negative")
        shape = tuple(self.runner.kv_shape(kv.num_blocks))
        if kv.shape != shape or kv.dtype != self.kv_dtype_name:
            raise KVHandoffError(f"pulled K/V {kv.dtype} {kv.shape} does not match this "
                                 f"engine's {self.kv_dtype_name} {shape}")
        hashes = self._prefix_hashes(token_ids)[: first_block + kv.num_blocks]
        if len(hashes) < first_block + kv.num_blocks:
            raise KVHandoffError(f"{kv.num_blocks} pulled blocks from block {first_block} "
                                 f"go past the prompt's {len(hashes)} full blocks")
        placed = self.blocks.insert_cached(token_ids, hashes, first_block)
        if self.tiers is not None:  # blocks evicted for these go down to disk first
            self.tiers.after_schedule()
        rows = [i for i, block in enumerate(placed) if block >= 0]
        if rows:
            data = torch.frombuffer(kv.data, dtype=torch.uint8) if not isinstance(
                kv.data, bytes) else torch.frombuffer(bytearray(kv.data), dtype=torch.uint8)
            tensor = data.view(self.kv_dtype).view(shape)
            self.runner.write_kv([placed[i] for i in rows],
                                 tensor[rows] if len(rows) < len(placed) else tensor)
        return len(rows)
