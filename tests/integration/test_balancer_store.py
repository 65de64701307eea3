"""The balancer keeps its newest placement in Redis for a restarted balancer: quick successive
placements never leave an older one stored, and one made while Redis was down is stored once
Redis is back."""

from __future__ import annotations

import asyncio

import redis
import torch

from evenflow.balancer.policy import TriggerConfig
from evenflow.balancer.role_balance import RoleBalance
from evenflow.balancer.service import BalancerService, placement_key
from evenflow.proto.messages import ExpertPlacement, decode
from evenflow.services.config import MeshConfig
from evenflow.services.launcher import start_redis
from evenflow.services.redis_conn import connect_redis


def stored_version(url: str) -> int:
    raw = redis.Redis.from_url(url).get(MeshConfig().redis_prefix + placement_key("decode"))
    stored = decode(raw) if raw else None
    return stored.version if isinstance(stored, ExpertPlacement) else 0


def balancer(url: str) -> tuple[BalancerService, RoleBalance]:
    """A balancer (not started) and its decode role's state, holding a 2 x 4 placement."""
    service = BalancerService(MeshConfig(redis_url=url), "eplb-test")
    service.redis = connect_redis(url)
    state = RoleBalance("decode", 8, 4, TriggerConfig())
    state.phy2log, state.shares = torch.arange(8).view(2, 4), torch.ones(2, 4)
    service.roles = {"decode": state}
    return service, state


def test_newest_placement_is_stored_even_across_a_redis_outage():
    server = start_redis()
    try:
        async def scenario() -> None:
            service, state = balancer(server.url)
            stores = []
            for version in (1, 2, 3):  # three placements in one burst
                state.version = version
                stores.append(asyncio.ensure_future(service._store_newest(state)))
            await asyncio.gather(*stores)
            assert stored_version(server.url) == 3
            server.proc.kill()
            server.proc.wait()
            state.version = 4
            await service._store_newest(state)  # fails quickly, without raising
            assert state.stored_version == 3
            await service.redis.aclose()

        asyncio.run(scenario())
        restarted = start_redis(server.port)
        try:
            async def after_restart() -> None:
                service, state = balancer(restarted.url)
                state.version, state.stored_version = 4, 3
                await service._store_newest(state)  # what the announcer does every 2 s
                await service.redis.aclose()
                fresh, fresh_state = balancer(restarted.url)
                fresh_state.version = 0
                await fresh._restore(fresh_state)
                assert fresh_state.version == 4
                await fresh.redis.aclose()

            asyncio.run(after_restart())
        finally:
            restarted.stop()
    finally:
        server.stop()
