"""The KV index's read side, used by the gateway: one-round-trip prefix match against Redis, and
predicted entries for requests just routed (so a burst sharing a new prefix sticks together
before the index catches up)."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from evenflow.kv_index import store
from evenflow.services.redis_conn import connect_redis


class KVIndexClient:
    def __init__(self, redis_url: str) -> None:
        self.redis: aioredis.Redis = connect_redis(redis_url)
        self._match = self.redis.register_script(store.MATCH)
        self._predict = self.redis.register_script(store.PREDICT)

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
        flat = await self._match(args=[time.time(), store.pack_hashes(block_hashes)])
        return {(m.decode() if isinstance(m, bytes) else m): int(n)
                for m, n in zip(flat[::2], flat[1::2], strict=True)}

    async def predict(self, predictions: dict[str, list[int]], ttl_ms: int) -> None:
        """member -> block hashes it is about to hold, kept for ttl_ms."""
        args: list[int | str | bytes] = [ttl_ms]
        for member, hashes in predictions.items():
            args += [member, store.pack_hashes(hashes)]
        await self._predict(args=args)

    async def close(self) -> None:
        await self.redis.aclose()
