"""The KV index service's message handling on the in-memory bus, against a real redis-server:
a gap in a worker's event numbers asks it for a snapshot, which replaces its entries; and a
draining worker keeps its lease (its cache still serves) until it stops heartbeating."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from evenflow.kv_index import store
from evenflow.kv_index.service import KVIndexService
from evenflow.proto import subjects
from evenflow.proto.messages import (
    BlockRemoved,
    BlockStored,
    KVEvents,
    KVResyncRequest,
    KVSnapshot,
    Message,
    Role,
    WorkerHeartbeat,
)
from evenflow.services.config import MeshConfig
from evenflow.services.launcher import start_redis
from evenflow.services.memory_bus import InMemoryBroker, InMemoryBus

KEYS = store.Keys(MeshConfig().redis_prefix)  # the default mesh's Redis namespace


@pytest.fixture
def redis_server():
    server = start_redis()
    yield server
    server.stop()


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.02)


def test_gap_resync_and_draining_lease(redis_server):
    config = MeshConfig(nats_url="memory://", redis_url=redis_server.url, worker_timeout_s=1.0)
    r = redis.Redis.from_url(redis_server.url)
    member = store.member_of("w1", "e1")

    def holds(h: int) -> bool:
        return bool(r.sismember(KEYS.block_key(h), member))

    async def scenario() -> None:
        broker = InMemoryBroker()
        index = KVIndexService(config, "kv0", InMemoryBus(broker, "kv0"))
        running = asyncio.create_task(index.run(install_signals=False))
        worker = InMemoryBus(broker, "w1")
        await worker.connect("memory://")
        resyncs: asyncio.Queue[Message] = asyncio.Queue()
        await worker.subscribe(subjects.kv_resync("w1"), lambda m, _c: resyncs.put_nowait(m))
        await asyncio.wait_for(index.started.wait(), 30)

        def events(seq: int, *batch: BlockStored | BlockRemoved) -> KVEvents:
            return KVEvents(worker_id="w1", role=Role.PREFILL, epoch="e1", seq=seq,
                            events=list(batch))

        try:
            await worker.publish(subjects.KV_EVENTS, events(1, BlockStored(
                block_hashes=[11, 12, 13])))
            await until(lambda: holds(13))
            await worker.publish(subjects.KV_EVENTS, events(3, BlockStored(
                block_hashes=[21], parent_block_hash=13)))  # event 2 was lost
            request = await asyncio.wait_for(resyncs.get(), 10)
            assert request == KVResyncRequest(worker_id="w1")
            await worker.publish(subjects.KV_EVENTS, KVSnapshot(
                worker_id="w1", role=Role.PREFILL, epoch="e1", seq=3, block_hashes=[11, 21]))
            await until(lambda: holds(21) and not holds(12) and not holds(13))
            # Numbering continues from the snapshot.
            await worker.publish(subjects.KV_EVENTS, events(4, BlockRemoved(block_hashes=[11])))
            await until(lambda: not holds(11))

            # A draining worker's heartbeats still renew its lease...
            for _ in range(15):
                await worker.publish(subjects.heartbeat(Role.PREFILL, "w1"), WorkerHeartbeat(
                    worker_id="w1", role=Role.PREFILL, model="tiny-moe", epoch="e1",
                    draining=True))
                await asyncio.sleep(0.1)
            assert holds(21), "a draining worker lost its index entries"
            # ...and once it leaves (no heartbeats past the timeout) its entries go.
            await until(lambda: not holds(21), timeout=10)
        finally:
            index.request_stop()
            await asyncio.wait_for(running, 30)
            await worker.close()

    try:
        asyncio.run(scenario())
    finally:
        r.close()


@pytest.mark.slow
def test_two_meshes_share_one_redis_without_seeing_each_other(redis_server):
    """Keys are per (model, mesh): two indexes on one Redis neither resync each other forever
    nor see each other's blocks."""
    async def scenario() -> None:
        broker_a, broker_b = InMemoryBroker(), InMemoryBroker()
        indexes = [KVIndexService(MeshConfig(nats_url="memory://", redis_url=redis_server.url,
                                             mesh_name=name), f"kv-{name}",
                                  InMemoryBus(broker, name))
                   for name, broker in (("a", broker_a), ("b", broker_b))]
        running = [asyncio.create_task(i.run(install_signals=False)) for i in indexes]
        workers = [InMemoryBus(broker_a, "wa"), InMemoryBus(broker_b, "wb")]
        resyncs: list[Message] = []
        for worker in workers:
            await worker.connect("memory://")
            await worker.subscribe(subjects.kv_resync("w1"), lambda m, _c: resyncs.append(m))
        for index in indexes:
            await asyncio.wait_for(index.started.wait(), 30)
        try:
            await workers[0].publish(subjects.KV_EVENTS, KVEvents(
                worker_id="w1", role=Role.PREFILL, epoch="e1", seq=1,
                events=[BlockStored(block_hashes=[77])]))
            await workers[1].publish(subjects.KV_EVENTS, KVEvents(
                worker_id="w1", role=Role.PREFILL, epoch="e1", seq=1,
                events=[BlockStored(block_hashes=[88])]))
            await asyncio.sleep(2.0)  # four watch periods
            assert not resyncs, "the two indexes keep asking for snapshots"
            r = redis.Redis.from_url(redis_server.url)
            member = store.member_of("w1", "e1")
            keys_a, keys_b = (store.Keys(i.config.redis_prefix) for i in indexes)
            assert r.sismember(keys_a.block_key(77), member)
            assert not r.sismember(keys_a.block_key(88), member)
            assert r.sismember(keys_b.block_key(88), member)
            r.close()
        finally:
            for index in indexes:
                index.request_stop()
            await asyncio.wait_for(asyncio.gather(*running), 30)
            for worker in workers:
                await worker.close()

    asyncio.run(scenario())
