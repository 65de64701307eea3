"""The KV index service on its own, driven over real NATS into a real Redis: a gap in a
worker's event numbering makes it ask for a snapshot, and the snapshot replaces what it held
(entries the worker lost meanwhile disappear); a `cleared` event empties the worker."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import nats
import redis

from evenflow.kv_index import store
from evenflow.proto import subjects
from evenflow.proto.messages import (
    AllBlocksCleared,
    BlockStored,
    KVEvents,
    KVResyncRequest,
    KVSnapshot,
    Role,
    decode,
    encode,
)
from evenflow.services.config import MeshConfig
from evenflow.services.launcher import start_nats, start_redis, stop_process

KEYS = store.Keys(MeshConfig().redis_prefix)  # the default mesh's Redis namespace


def test_gap_resyncs_from_a_snapshot_and_cleared_empties_the_worker():
    nats_server, redis_server = start_nats(), start_redis()
    config = MeshConfig(nats_url=nats_server.url, redis_url=redis_server.url)
    proc = subprocess.Popen([sys.executable, "-m", "evenflow.kv_index", "kvtest"],
                            env={**config.to_env(), "PATH": ""}, stderr=subprocess.DEVNULL)
    r = redis.Redis.from_url(redis_server.url)
    member = store.member_of("w1", "e1")

    def holds(h: int) -> bool:
        return bool(r.sismember(KEYS.block_key(h), member))

    async def until(predicate, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.02)

    async def scenario() -> None:
        nc = await nats.connect(nats_server.url)
        resyncs: asyncio.Queue = asyncio.Queue()

        async def on_resync(msg) -> None:
            resyncs.put_nowait(decode(msg.data))

        await nc.subscribe(subjects.kv_resync("w1"), cb=on_resync)

        async def send(message) -> None:
            await nc.publish(subjects.KV_EVENTS, encode(message))
            await nc.flush()

        # Events 1..: the service may still be subscribing, so resend until it lands.
        def events(seq: int, *batch: BlockStored | AllBlocksCleared) -> KVEvents:
            return KVEvents(worker_id="w1", role=Role.PREFILL, epoch="e1", seq=seq,
                            events=list(batch))

        first = events(1, BlockStored(block_hashes=[11, 12, 13]))
        deadline = time.monotonic() + 15
        while not holds(13):
            assert time.monotonic() < deadline, "the index never applied the first events"
            await send(first)
            await asyncio.sleep(0.2)
        # Event 2 is lost; 3 arrives: a gap. The worker meanwhile evicted 12 and 13.
        await send(events(3, BlockStored(block_hashes=[21], parent_block_hash=13)))
        request = await asyncio.wait_for(resyncs.get(), 10)
        assert isinstance(request, KVResyncRequest) and request.worker_id == "w1"
        await send(KVSnapshot(worker_id="w1", role=Role.PREFILL, epoch="e1", seq=3,
                              block_hashes=[11, 21]))
        await until(lambda: holds(21) and not holds(12) and not holds(13))
        assert holds(11)
        # Numbering continues from the snapshot; `cleared` drops everything.
        await send(events(4, AllBlocksCleared()))
        await until(lambda: not holds(11) and not holds(21))
        assert not r.exists(KEYS.member_key(member))
        await nc.close()

    try:
        asyncio.run(scenario())
    finally:
        stop_process(proc, timeout_s=30)
        r.close()
        nats_server.stop()
        redis_server.stop()


def test_predictions_are_shared_through_redis_and_expire():
    """What one gateway just routed, another gateway's match sees, for the prediction TTL."""
    from evenflow.kv_index.client import KVIndexClient
    from evenflow.proto.hashing import chain_hashes

    server = start_redis()

    async def scenario() -> None:
        routing = KVIndexClient(server.url, KEYS, lookup_timeout_s=5, prediction_ttl_ms=1500)
        other = KVIndexClient(server.url, KEYS)
        hashes = chain_hashes(list(range(64 * 16)), 16)
        holder, predicted = store.member_of("p0", "e"), store.member_of("p1", "e")
        await other.redis.zadd(KEYS.leases, {holder: time.time() + 60,
                                              predicted: time.time() + 60})
        for h in hashes[:10]:  # p0 really holds the first 10 blocks
            await other.redis.sadd(KEYS.block_key(h), holder)
        routing.predict(hashes, {"p1": ("e", 0)})
        await routing.flush_predictions()
        assert await other.match(hashes) == {holder: 10, predicted: 64}
        await asyncio.sleep(1.8)
        assert await other.match(hashes) == {holder: 10}
        # A prediction past what a worker holds extends its match.
        routing.predict(hashes[:20], {"p0": ("e", 10)})
        await routing.flush_predictions()
        assert await other.match(hashes) == {holder: 20}
        # The predicting gateway sees its own predictions at once, merged with Redis's view.
        routing.predict(hashes[:30], {"p0": ("e", 20)})
        assert await routing.lookup(hashes, {"p0": "e", "p1": "e"}.get) == {"p0": 30}
        await routing.close()
        await other.close()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_sigterm_with_nats_and_redis_gone_exits_cleanly():
    """A service whose NATS and Redis died still stops promptly on SIGTERM (no hang, exit 0)."""
    nats_server, redis_server = start_nats(), start_redis()
    config = MeshConfig(nats_url=nats_server.url, redis_url=redis_server.url)
    proc = subprocess.Popen([sys.executable, "-m", "evenflow.kv_index", "kvstop"],
                            env={**config.to_env(), "PATH": ""}, stderr=subprocess.DEVNULL)
    try:
        r = redis.Redis.from_url(redis_server.url)
        deadline = time.monotonic() + 15
        while not r.exists(KEYS.instance):  # the service is up
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r.close()
        nats_server.stop()
        redis_server.stop()
        time.sleep(1.0)  # the clients are reconnecting now
        proc.terminate()
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        nats_server.stop()
        redis_server.stop()
