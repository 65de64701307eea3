"""A gateway's own copy of the KV block index, fed by the workers' KV-event stream (the one the
KV index service writes to Redis), so that a routing decision is a few set lookups (the same
binary search per worker as the Redis script) instead of a Redis round trip. Redis stays the
source of truth: a copy that is behind for a worker — it has not seen that worker's snapshot
yet, or it missed an event (a gap in the worker's sequence) — says so, and the caller asks
Redis instead (and counts it) until the worker's snapshot, which the copy asks for itself,
arrives.

Members are (worker, epoch) as in Redis; a worker's new epoch replaces its old member. Not in
the copy: the other gateways' predictions (Redis has them; this gateway's own stay merged in,
kv_index/client.py), so with several gateways a burst sharing a new prefix sticks a little less
across gateways than through Redis.

Workers' KV disk tiers (events and snapshot parts with medium "disk") are kept here only (the
Redis index holds RAM): a match counts a worker's RAM run in full and the disk blocks that
extend it at `disk_credit` each (a promotion costs less than a recompute, more than a RAM hit;
bench/offline/tiers_bench.py measures it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from evenflow.proto.messages import (
    DISK_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvents,
    KVSnapshot,
)

RESYNC_EVERY_S = 2.0  # a worker not yet synced is asked for its snapshot at most this often


@dataclass
class _Copy:
    epoch: str
    last_seq: int = 0
    synced: bool = False  # a snapshot, then every event since, without a gap
    blocks: set[int] = field(default_factory=set)
    disk: set[int] = field(default_factory=set)  # its disk tier's blocks
    asked_at: float = 0.0  # when its snapshot was last requested


class LocalIndex:
    def __init__(self) -> None:
        self.workers: dict[str, _Copy] = {}  # worker_id -> its copy
        self.holders: dict[int, set[str]] = {}  # block hash -> worker ids holding it in RAM
        self.disk_holders: dict[int, set[str]] = {}  # ... on their disk tier

    def _copy(self, worker_id: str, epoch: str) -> _Copy:
        copy = self.workers.get(worker_id)
        if copy is None or copy.epoch != epoch:  # new, or restarted: forget the old epoch
            if copy is not None:
                self._drop_blocks(worker_id, copy)
            copy = self.workers[worker_id] = _Copy(epoch)
        return copy

    def _drop_blocks(self, worker_id: str, copy: _Copy) -> None:
        for h in copy.blocks:
            _unhold(self.holders, h, worker_id)
        for h in copy.disk:
            _unhold(self.disk_holders, h, worker_id)
        copy.blocks, copy.disk = set(), set()

    def apply(self, message: KVEvents | KVSnapshot) -> None:
        """One message of the KV-event stream."""
        copy = self._copy(message.worker_id, message.epoch)
        if isinstance(message, KVSnapshot):
            if copy.synced and message.seq <= copy.last_seq:
                return  # (another subscriber's resync: we are current already)
            self._drop_blocks(message.worker_id, copy)
            for h in message.block_hashes:
                self._add(message.worker_id, copy, h)
            for h in message.disk_block_hashes:
                self._add(message.worker_id, copy, h, DISK_MEDIUM)
            copy.synced, copy.last_seq = True, message.seq
            return
        if not copy.synced or message.seq <= copy.last_seq:
            return  # a snapshot will cover it, or we have it already
        if message.seq != copy.last_seq + 1:
            copy.synced = False  # missed some: behind until a snapshot
            return
        copy.last_seq = message.seq
        for event in message.events:
            if isinstance(event, AllBlocksCleared):
                self._drop_blocks(message.worker_id, copy)
            elif isinstance(event, BlockStored):
                for h in event.block_hashes:
                    self._add(message.worker_id, copy, h, event.medium)
            elif isinstance(event, BlockRemoved):
                disk = event.medium == DISK_MEDIUM
                blocks, holders = (copy.disk, self.disk_holders) if disk else (
                    copy.blocks, self.holders)
                for h in event.block_hashes:
                    blocks.discard(h)
                    _unhold(holders, h, message.worker_id)

    def _add(self, worker_id: str, copy: _Copy, h: int, medium: str | None = None) -> None:
        if medium == DISK_MEDIUM:
            copy.disk.add(h)
            self.disk_holders.setdefault(h, set()).add(worker_id)
        else:
            copy.blocks.add(h)
            self.holders.setdefault(h, set()).add(worker_id)

    def forget(self, worker_id: str) -> None:
        """A worker that left."""
        copy = self.workers.pop(worker_id, None)
        if copy is not None:
            self._drop_blocks(worker_id, copy)

    def behind(self, live: dict[str, str]) -> list[str]:
        """Live workers (worker_id -> current epoch) this copy cannot answer for."""
        return [w for w, epoch in live.items()
                if (copy := self.workers.get(w)) is None or copy.epoch != epoch
                or not copy.synced]

    def to_resync(self, live: dict[str, str], now: float | None = None) -> list[str]:
        """Behind workers whose snapshot was not asked for within RESYNC_EVERY_S (marked
        asked now)."""
        now = time.monotonic() if now is None else now
        due = []
        for w in self.behind(live):
            copy = self._copy(w, live[w])
            if now - copy.asked_at >= RESYNC_EVERY_S:
                copy.asked_at = now
                due.append(w)
        return due

    def match(self, block_hashes: list[int], live: dict[str, str], disk_credit: float = 0.0
              ) -> dict[str, float]:
        """worker_id -> how many leading blocks of `block_hashes` it holds (live workers), as
        the Redis index answers it (store.MATCH): the workers holding the first block, each
        by a binary search for its run's end (a worker's RAM holdings are prefix-closed: a
        block is cached only with its parents, and evicted before them). With disk_credit > 0,
        plus disk_credit for each block after that run which its disk tier holds (until the
        first block held nowhere)."""
        if not block_hashes:
            return {}
        disk_credit = disk_credit if self.disk_holders else 0.0  # (no disk tier anywhere)
        first = self.holders.get(block_hashes[0], set())
        if disk_credit > 0:
            first = first | self.disk_holders.get(block_hashes[0], set())
        matched: dict[str, float] = {}
        for w in first & live.keys():
            copy = self.workers[w]
            lo, hi = 0, len(block_hashes)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if block_hashes[mid - 1] in copy.blocks:
                    lo = mid
                else:
                    hi = mid - 1
            extra = 0
            if disk_credit > 0 and copy.disk:
                while lo + extra < len(block_hashes) and (
                        block_hashes[lo + extra] in copy.disk
                        or block_hashes[lo + extra] in copy.blocks):
                    extra += 1
            matched[w] = lo + disk_credit * extra
        return matched


def _unhold(holders: dict[int, set[str]], h: int, worker_id: str) -> None:
    held = holders.get(h)
    if held is not None:
        held.discard(worker_id)
        if not held:
            del holders[h]
