"""The Redis connection every service uses: short timeouts (a dead Redis must cost
milliseconds, not redis-py's multi-second defaults), no retries hidden inside a call."""

from __future__ import annotations

import redis.asyncio as aioredis

CONNECT_TIMEOUT_S = 0.25
COMMAND_TIMEOUT_S = 0.25


def connect_redis(url: str) -> aioredis.Redis:
    """A lazily connecting client; the first command opens the connection."""
    return aioredis.Redis.from_url(
        url, socket_connect_timeout=CONNECT_TIMEOUT_S, socket_timeout=COMMAND_TIMEOUT_S,
        retry_on_timeout=False, health_check_interval=5, decode_responses=False)


async def redis_available(client: aioredis.Redis) -> bool:
    try:
        return bool(await client.ping())
    except (aioredis.ConnectionError, aioredis.TimeoutError, OSError):
        return False
