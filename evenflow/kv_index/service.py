"""The KV index service: KV events in (NATS) -> Redis, off every request's critical path.

Events are applied in batched pipelines. Each (worker, epoch) is a member whose events must
arrive numbered 1, 2, 3, ...; a gap, a Redis restart (the instance marker disappears) or a Redis
outage makes the index ask that worker for a snapshot of its whole block set and replace the
member's entries with it. Heartbeats renew members' leases; a member whose lease lapses is
dropped. A worker that restarts has a new epoch: its previous member is dropped at once.

Redis holds what workers hold in RAM only: events of a KV disk tier (medium "disk") are skipped
here; each gateway's local copy (kv_index/local_copy.py) keeps them and gives them less credit.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import redis.asyncio as aioredis
from prometheus_client import Counter

from evenflow.kv_index import store
from evenflow.proto import subjects
from evenflow.proto.messages import (
    DISK_MEDIUM,
    WORKER_ROLES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvents,
    KVResyncRequest,
    KVSnapshot,
    Message,
    Role,
    WorkerHeartbeat,
)
from evenflow.services.redis_conn import connect_redis
from evenflow.services.worker import WorkerService

log = logging.getLogger(__name__)
SHUTDOWN_STEP_S = 3.0  # each step of the index's shutdown, at most (the teardown's bound: 10)


def _where(task: asyncio.Future) -> str:
    """Where a task is suspended: its innermost frames, file:line."""
    stack = task.get_stack(limit=4) if isinstance(task, asyncio.Task) else []
    return " <- ".join(f"{f.f_code.co_filename.rsplit('/', 2)[-1]}:{f.f_lineno}"
                       for f in reversed(stack)) or "unknown"

EVENTS_APPLIED = Counter("evenflow_kv_index_events_total", "KV events applied to Redis")
RESYNCS = Counter("evenflow_kv_index_resyncs_total", "Snapshots requested", ["reason"])
REDIS_ERRORS = Counter("evenflow_kv_index_redis_errors_total", "Failed Redis writes")


@dataclass
class _Member:
    worker_id: str
    epoch: str
    last_seq: int = 0
    resyncing: bool = False


class KVIndexService(WorkerService):
    role = Role.KV_INDEX
    FLUSH_INTERVAL_S = 0.002  # writes arriving this close together share one pipeline

    async def start(self) -> None:
        assert self.config.redis_url, "the KV index needs redis_url"
        self.redis: aioredis.Redis = connect_redis(self.config.redis_url)
        self._drop = self.redis.register_script(store.DROP_MEMBER)
        self.keys = store.Keys(self.config.redis_prefix)
        self.instance = uuid.uuid4().hex
        self.members: dict[str, _Member] = {}  # member -> state
        self.pending: list[tuple[str, str, int, int]] = []  # (op, member, hash, events) to write
        self.leases: dict[str, float] = {}  # member -> expiry, to write
        self._dirty = asyncio.Event()  # set when pending or leases gain something
        self.events_applied = 0
        self.redis_ok = False
        try:  # plant our marker now, so health reflects Redis from the start
            await self.redis.set(self.keys.instance, self.instance)
            self.redis_ok = True
        except (aioredis.ConnectionError, aioredis.TimeoutError, OSError):
            log.warning("Redis is unreachable at start; the index waits for it")
        self._tasks = [asyncio.create_task(self._flusher(), name="kv flush"),
                       asyncio.create_task(self._watch(), name="kv watch")]
        await self.bus.subscribe(subjects.KV_EVENTS, self._on_kv)
        await self.bus.subscribe(subjects.HEARTBEATS, self._on_heartbeat)

    def healthy(self) -> str | None:
        return None if self.redis_ok else "Redis is unreachable"

    def heartbeat(self) -> WorkerHeartbeat:
        return WorkerHeartbeat(worker_id=self.worker_id, role=self.role,
                               model=self.config.model_name, sent_at=time.time(),
                               epoch=self.epoch, draining=self.draining,
                               metrics_port=self.config.metrics_port)

    async def shutdown(self) -> None:
        """Each step bounded (SHUTDOWN_STEP_S), what overran named in an INFO line: in CI a
        Ctrl-C of `up` saw this shutdown pass the worker's 10 s teardown bound now and then,
        never reproduced here; the process exits anyway, so the index need not wait."""
        for task in self._tasks:
            task.cancel()
        _, pending = await asyncio.wait(self._tasks, timeout=SHUTDOWN_STEP_S)
        for task in pending:
            log.info("kv index: %s did not end within %.0f s of its cancel (at %s); exiting "
                     "without it", task.get_name(), SHUTDOWN_STEP_S, _where(task))
        closing = asyncio.ensure_future(self.redis.aclose())
        _, pending = await asyncio.wait([closing], timeout=SHUTDOWN_STEP_S)
        if pending:
            log.info("kv index: closing the Redis connection took over %.0f s (at %s); "
                     "exiting without it", SHUTDOWN_STEP_S, _where(closing))

    # -- inbound ----------------------------------------------------------------------------
    def _on_heartbeat(self, message: Message, _ctx: object) -> None:
        # A draining worker keeps its lease (its cache still serves until it leaves).
        if isinstance(message, WorkerHeartbeat) and message.role in WORKER_ROLES:
            member = store.member_of(message.worker_id, message.epoch)
            self.leases[member] = time.time() + self.config.worker_timeout_s
            self._dirty.set()

    def _on_kv(self, message: Message, _ctx: object) -> None:
        if isinstance(message, KVEvents):
            self._on_events(message)
        elif isinstance(message, KVSnapshot):
            self._on_snapshot(message)
        self._dirty.set()

    def _member(self, worker_id: str, epoch: str) -> tuple[str, _Member]:
        member = store.member_of(worker_id, epoch)
        state = self.members.get(member)
        if state is None:
            for old, old_state in list(self.members.items()):  # a restarted worker
                if old_state.worker_id == worker_id:
                    del self.members[old]
                    self.pending.append(("drop", old, 0, 0))
            state = self.members[member] = _Member(worker_id, epoch)
        return member, state

    def _on_events(self, msg: KVEvents) -> None:
        member, state = self._member(msg.worker_id, msg.epoch)
        if state.resyncing or msg.seq <= state.last_seq:
            return  # the snapshot will cover it, or we have it already
        if msg.seq != state.last_seq + 1:
            self._request_resync(state, "gap")
            return
        state.last_seq = msg.seq
        for event in msg.events:
            if isinstance(event, AllBlocksCleared):
                self.pending.append(("drop", member, 0, 1))
            elif isinstance(event, BlockStored | BlockRemoved):
                if event.medium == DISK_MEDIUM:
                    continue  # the disk tier: gateways' local copies keep it (local_copy.py)
                op = "add" if isinstance(event, BlockStored) else "rem"
                self.pending.extend((op, member, h, 1) for h in event.block_hashes)

    def _on_snapshot(self, snap: KVSnapshot) -> None:
        member, state = self._member(snap.worker_id, snap.epoch)
        # taken: one asked for, or a new epoch's before any of its events (a worker that
        # switched role announces the cache it kept: services/engine_worker.py)
        if not (state.resyncing or state.last_seq == 0 == snap.seq):
            return
        state.resyncing, state.last_seq = False, snap.seq
        self.pending.append(("drop", member, 0, 0))
        self.pending.extend(("add", member, h, 0) for h in snap.block_hashes)

    def _request_resync(self, state: _Member, reason: str) -> None:
        if state.resyncing:
            return
        state.resyncing = True
        RESYNCS.labels(reason=reason).inc()
        self.send(subjects.kv_resync(state.worker_id), KVResyncRequest(worker_id=state.worker_id))

    # -- writing to Redis -------------------------------------------------------------------
    async def _flusher(self) -> None:
        """Waits for something to write (an idle index never wakes up: a 2 ms poll cost ~4%
        of a CPU), lets a burst gather for FLUSH_INTERVAL_S, and writes it in one pipeline."""
        while True:
            await self._dirty.wait()
            await asyncio.sleep(self.FLUSH_INTERVAL_S)
            self._dirty.clear()
            if not self.pending and not self.leases:
                continue
            ops, self.pending = self.pending, []
            leases, self.leases = self.leases, {}
            try:
                await self._write(ops, leases)
            except (aioredis.ConnectionError, aioredis.TimeoutError, OSError) as exc:
                REDIS_ERRORS.inc()
                if self.redis_ok:
                    log.warning("Redis write failed (%s): will resync when it is back", exc)
                self.redis_ok = False  # whatever was lost is recovered by a resync

    async def _write(self, ops: list[tuple[str, str, int, int]], leases: dict[str, float]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        applied = 0
        for op, member, block_hash, events in ops:
            if op == "add":
                pipe.sadd(self.keys.block_key(block_hash), member)
                pipe.sadd(self.keys.member_key(member), store.hash_bytes(block_hash))
            elif op == "rem":
                pipe.srem(self.keys.block_key(block_hash), member)
                pipe.srem(self.keys.member_key(member), store.hash_bytes(block_hash))
            else:  # queued into the pipeline (the await only queues it)
                await self._drop(args=[self.keys.prefix, member], client=pipe)
            applied += events
        if leases:
            pipe.zadd(self.keys.leases, leases)
        await pipe.execute()
        self.events_applied += applied
        EVENTS_APPLIED.inc(applied)

    async def _watch(self) -> None:
        """Every half second: detect a Redis restart or recovery (then resync every member),
        and drop members whose lease has lapsed."""
        while True:
            await asyncio.sleep(0.5)
            try:
                marker = await self.redis.get(self.keys.instance)
                if marker != self.instance.encode() or not self.redis_ok:
                    # Restarted (empty) or back from an outage (writes lost): rebuild from
                    # every member's snapshot.
                    reason = "redis_recovered" if marker else "redis_restart"
                    await self.redis.set(self.keys.instance, self.instance)
                    for state in self.members.values():
                        state.resyncing = False
                        self._request_resync(state, reason)
                    self.redis_ok = True
                expired = await self.redis.zrangebyscore(self.keys.leases, "-inf", time.time())
                for raw in expired:
                    member = raw.decode() if isinstance(raw, bytes) else str(raw)
                    await self._drop(args=[self.keys.prefix, member])
                    self.members.pop(member, None)
            except (aioredis.ConnectionError, aioredis.TimeoutError, OSError):
                self.redis_ok = False
