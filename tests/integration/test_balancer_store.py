"""The balancer keeps its newest placement in Redis for a restarted balancer: quick successive
placements never leave an older one stored, and one made while Redis was down is stored once
Redis is back."""

from __future__ import annotations

import asyncio

import redis
import torch

from evenflow.balancer.service import PLACEMENT_KEY, BalancerService
from evenflow.proto.messages import ExpertPlacement, decode
from evenflow.services.config import MeshConfig
from evenflow.services.launcher import start_redis
from evenflow.services.redis_conn import connect_redis


def stored_version(url: str) -> int:
    raw = redis.Redis.from_url(url).get(MeshConfig().redis_prefix + PLACEMENT_KEY)
    stored = decode(raw) if raw else None
    return stored.version if isinstance(stored, ExpertPlacement) else 0


def balancer(url: str) -> BalancerService:
    service = BalancerService(MeshConfig(redis_url=url), "eplb-test")
    service.redis = connect_redis(url)
    service._store_lock = asyncio.Lock()
    service.version, service.stored_version = 0, 0
    service.phy2log, service.shares = torch.arange(8).view(2, 4), torch.ones(2, 4)
    service.history = {}
    return service


def test_newest_placement_is_stored_even_across_a_redis_outage():
    server = start_redis()
    try:
        async def scenario() -> None:
            service = balancer(server.url)
            stores = []
            for version in (1, 2, 3):  # three placements in one burst
                service.version = version
                stores.append(asyncio.ensure_future(service._store_newest()))
            await asyncio.gather(*stores)
            assert stored_version(server.url) == 3
            server.proc.kill()
            server.proc.wait()
            service.version = 4
            await service._store_newest()  # fails quickly, without raising
            assert service.stored_version == 3
            await service.redis.aclose()

        asyncio.run(scenario())
        restarted = start_redis(server.port)
        try:
            async def after_restart() -> None:
                service = balancer(restarted.url)
                service.version, service.stored_version = 4, 3
                await service._store_newest()  # what the announcer does every 2 s
                await service.redis.aclose()
                fresh = balancer(restarted.url)
                await fresh._restore()
                assert fresh.version == 4
                await fresh.redis.aclose()

            asyncio.run(after_restart())
        finally:
            restarted.stop()
    finally:
        server.stop()
