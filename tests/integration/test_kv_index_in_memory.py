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
        return bool(r.sismember(store.block_key(h), member))

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
