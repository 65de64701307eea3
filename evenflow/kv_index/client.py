"""The KV index's read side, used by the gateway: one-round-trip prefix match against Redis, and
predictions for requests just routed (so a burst sharing a new prefix sticks together before the
index catches up). Predictions live in two places: this gateway's own table (seen at once by
its next request) and Redis (seen by other gateways), both expiring after a TTL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

import redis.asyncio as aioredis

from evenflow.kv_index import store
from evenflow.services.redis_conn import connect_redis

MAX_LOCAL_PREDICTIONS = 100_000  # block hashes; past it the expired ones are dropped


# A gateway's predictions go to Redis together, at most this late: one script call per batch,
# not one per request (the gateway's own copy of them is made at once).
PREDICTION_BATCH_S = 0.05


class KVIndexClient:
    def __init__(self, redis_url: str, keys: store.Keys, lookup_timeout_s: float = 0.05,
                 prediction_ttl_ms: int = 2000) -> None:
        self.redis: aioredis.Redis = connect_redis(redis_url)
        self.keys = keys
        self.lookup_timeout_s, self.prediction_ttl_ms = lookup_timeout_s, prediction_ttl_ms
        self._match = self.redis.register_script(store.MATCH)
        self._predict = self.redis.register_script(store.PREDICT)
        # This gateway's own recent predictions, block hash -> {worker_id: expiry}.
        self._predicted: dict[int, dict[str, float]] = {}
        self._writes: set[asyncio.Task] = set()  # prediction writes in flight (owned here)
        # predictions not written yet: (member, packed hashes) pairs, written together
        self._pending: list[str | bytes] = []
        self._flush: asyncio.TimerHandle | None = None

    async def warm_up(self, connections: int = 16) -> None:
        """Open `connections` pooled connections and load the scripts now, so the first requests'
        matches do not pay for a connection handshake or a NOSCRIPT retry (10-50 ms on a loaded
        machine, past the lookup timeout). Raises redis errors."""
        await asyncio.gather(*(self.redis.ping() for _ in range(connections)))
        await self.redis.script_load(store.MATCH)
        await self.redis.script_load(store.PREDICT)

    async def match(self, block_hashes: list[int]) -> dict[str, int]:
        """member -> how many leading blocks of `block_hashes` it holds (live members only).
        Raises redis errors (the caller falls back to load-only routing)."""
        if not block_hashes:
            return {}
        flat = await self._match(args=[self.keys.prefix, time.time(),
                                       store.pack_hashes(block_hashes)])
        return {(m.decode() if isinstance(m, bytes) else m): int(n)
                for m, n in zip(flat[::2], flat[1::2], strict=True)}

    async def lookup(self, block_hashes: list[int],
                     epoch_of: Callable[[str], str | None]) -> dict[str, float] | None:
        """worker_id -> cached leading blocks, for workers of the given current epochs, merged
        with this gateway's live predictions; None when Redis is down or slower than the
        lookup timeout (route by load alone)."""
        try:
            members = await asyncio.wait_for(self.match(block_hashes), self.lookup_timeout_s)
        except Exception:  # Redis down or slow: never fail the request over it
            return None
        matched: dict[str, float] = {}
        for member, blocks in members.items():
            worker_id, epoch = store.split_member(member)
            if epoch_of(worker_id) == epoch:
                matched[worker_id] = blocks
        return self.with_predictions(matched, block_hashes)

    def with_predictions(self, matched: dict[str, float], block_hashes: list[int]
                         ) -> dict[str, float]:
        """`matched` (from Redis or the gateway's own copy) merged with this gateway's live
        predictions."""
        for worker_id, blocks in self._local_prefix(block_hashes).items():
            matched[worker_id] = max(matched.get(worker_id, 0), blocks)
        return matched

    def _local_prefix(self, block_hashes: list[int]) -> dict[str, int]:
        """worker -> how many leading blocks it is predicted to hold (unexpired): each worker's
        run ends at the first block it lacks, so the set of workers still running only
        shrinks, block by block."""
        first = self._predicted.get(block_hashes[0]) if block_hashes else None
        if not first:
            return {}
        now = time.monotonic()
        running = {w for w, expiry in first.items() if expiry > now}
        local: dict[str, int] = {}
        for i, h in enumerate(block_hashes[1:], start=1):
            if not running:
                return local
            entry = self._predicted.get(h)
            ended = running if entry is None else {
                w for w in running if entry.get(w, 0.0) <= now}
            for w in ended:
                local[w] = i
            running = running - ended
        for w in running:
            local[w] = len(block_hashes)
        return local

    def predict(self, block_hashes: list[int], workers: dict[str, tuple[str, int]]) -> None:
        """Workers about to hold `block_hashes`: worker_id -> (epoch, blocks it already has).
        Recorded here at once and written to Redis in the background (a lost write costs a
        little stickiness, nothing else)."""
        self.remember(block_hashes, workers)
        if not block_hashes:
            return
        for w, (epoch, have) in workers.items():
            self._pending += [store.member_of(w, epoch), store.pack_hashes(block_hashes[have:])]
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(PREDICTION_BATCH_S,
                                                                self._write_pending)

    def _write_pending(self) -> None:
        """The predictions made since the last write, in one script call."""
        self._flush = None
        pending, self._pending = self._pending, []
        if pending:
            task = asyncio.create_task(self._write_predictions(pending))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    def remember(self, block_hashes: list[int], worker_ids: Iterable[str]) -> None:
        """Workers about to hold `block_hashes`, in this gateway's own predictions only (what
        another gateway routed: it wrote Redis itself)."""
        expiry = time.monotonic() + self.prediction_ttl_ms / 1000
        if len(self._predicted) > MAX_LOCAL_PREDICTIONS:
            now = time.monotonic()
            self._predicted = {h: d for h, d in self._predicted.items()
                               if max(d.values()) > now}
        worker_ids = tuple(worker_ids)
        for h in block_hashes:
            entry = self._predicted.setdefault(h, {})
            for worker_id in worker_ids:
                entry[worker_id] = expiry

    async def _write_predictions(self, pairs: list[str | bytes]) -> None:
        args: list[int | str | bytes] = [self.keys.prefix, self.prediction_ttl_ms, *pairs]
        try:
            await asyncio.wait_for(self._predict(args=args), self.lookup_timeout_s)
        except Exception:  # see predict(): best effort by design
            pass

    async def flush_predictions(self) -> None:
        """Write what waits now, and wait for the prediction writes in flight."""
        if self._flush is not None:
            self._flush.cancel()
            self._write_pending()
        await asyncio.gather(*self._writes, return_exceptions=True)

    async def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
        for task in self._writes:
            task.cancel()
        await asyncio.gather(*self._writes, return_exceptions=True)
        await self.redis.aclose()
