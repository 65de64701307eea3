"""The gateway's view of the worker fleet: one NATS connection; this gateway's inbox
demultiplexed to the requests in flight (TokenDeltas, ErrorMessage) and to profile waiters;
heartbeats in (the worker registry) and out (workers drop the requests of a gateway that goes
quiet); the other gateways' routing state (peers.py); and this gateway's copy of the KV index
kept in step with the workers (their snapshots asked for where it is behind)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

from opentelemetry.context import Context

from evenflow.gateway.flight import Flight, RequestFailed
from evenflow.gateway.peers import PeerGateways
from evenflow.gateway.router import RouterWeights, WorkerRegistry
from evenflow.kv_index.client import KVIndexClient
from evenflow.kv_index.local_copy import LocalIndex
from evenflow.kv_index.store import Keys
from evenflow.proto import errors, subjects
from evenflow.proto.messages import (
    WORKER_ROLES,
    ErrorMessage,
    KVEvents,
    KVResyncRequest,
    KVSnapshot,
    Message,
    ProfileRequest,
    ProfileResult,
    Role,
    TokenDeltas,
    WorkerHeartbeat,
)
from evenflow.services.bus import MessageBus, NatsAuthError, unreachable_reason
from evenflow.services.config import MeshConfig
from evenflow.services.metrics import LIVE_WORKERS, export_worker_figures

log = logging.getLogger(__name__)

PROFILE_GRACE_S = 30.0  # a profile's answer may come this long after its window (trace export)
# at start, readiness waits this long at most for the index copy to be in step with the workers
COPY_SYNC_GRACE_S = 5.0


class Fleet:
    def __init__(self, config: MeshConfig, bus: MessageBus, gateway_id: str) -> None:
        self.config, self.bus, self.gateway_id = config, bus, gateway_id
        self.inbox = subjects.gateway_inbox(gateway_id)
        self.registry = WorkerRegistry(config.worker_timeout_s, RouterWeights(
            config.router, config.kv_overlap_weight, config.decode_load_weight,
            config.load_cap_blocks, config.router_temperature), own_subject=self.inbox,
            gap_s=4 * config.heartbeat_interval_s)
        self.kv = KVIndexClient(config.redis_url, Keys(config.redis_prefix),
                                config.kv_lookup_timeout_s, config.prediction_ttl_ms) if (
            config.redis_url and config.router == "kv") else None
        # this gateway's own copy of the index, from the KV-event stream (Redis answers while
        # it is behind)
        self.kv_copy = LocalIndex() if self.kv is not None and config.kv_index_local_copy \
            else None
        self.peers = PeerGateways(self.inbox, self.registry, self.kv,
                                  config.router_sync_interval_s)
        self.flights: dict[str, Flight] = {}  # by wire id (an attempt's)
        self._profiles: dict[str, asyncio.Future[ProfileResult]] = {}  # POST /admin/profile
        self._heartbeats: asyncio.Task | None = None
        self._syncs: asyncio.Task | None = None
        self._connecting: asyncio.Task | None = None  # retrying a NATS that was down at start
        self._ready_since: float | None = None
        self._copy_ready = False  # the index copy was in step once (or the grace ran out)

    async def start(self) -> None:
        """Connect, or keep trying in the background: the HTTP side serves meanwhile, and
        answers 503 (health and requests) until NATS is there."""
        assert self.config.nats_url, "nats_url is required"
        try:
            await asyncio.wait_for(self._connect(), timeout=3.0)
        except NatsAuthError:
            raise  # refused credentials: the gateway cannot serve, and says so (app.py)
        except Exception as exc:  # nats-py retries a first connect forever: stop waiting
            log.warning("NATS unreachable at start (%s at %s); still trying",
                        unreachable_reason(exc, self.bus), self.config.nats_url)
            self._connecting = asyncio.create_task(self._connect_until_up(), name="connect")
        if self.kv is not None:
            try:
                await self.kv.warm_up()
            except Exception as exc:  # Redis down: route by load until it is back
                log.warning("KV index not reachable at start (%s); routing by load until it is",
                            exc)

    async def _connect(self) -> None:
        assert self.config.nats_url
        await self.bus.connect(self.config.nats_url, timeout_s=2.0,
                               security=self.config.nats_security())
        await self.bus.subscribe(self.inbox, self._on_inbox)
        await self.bus.subscribe(subjects.HEARTBEATS, self._on_heartbeat)
        if self.kv_copy is not None:
            await self.bus.subscribe(subjects.KV_EVENTS, self._on_kv_events)
        self._heartbeats = asyncio.create_task(self._heartbeat(), name="gateway heartbeats")
        if self.config.router_sync_interval_s > 0:
            await self.bus.subscribe(subjects.router_sync("*"), self.peers.on_sync)
            self._syncs = asyncio.create_task(self.peers.run(self.bus), name="router syncs")

    async def _connect_until_up(self) -> None:
        while True:
            try:
                await self._connect()  # retries inside until the server answers
            except Exception:  # refused outright (say, bad credentials): try again later
                await asyncio.sleep(1.0)
                continue
            log.info("connected to NATS")
            return

    async def _heartbeat(self) -> None:
        """The gateway is alive: workers drop the requests of one that stops saying so."""
        beat = WorkerHeartbeat(worker_id=self.gateway_id, role=Role.GATEWAY,
                               model=self.config.model_name)
        while True:
            try:
                await self.bus.publish(subjects.heartbeat(
                    Role.GATEWAY, self.gateway_id), dataclasses.replace(
                    beat, sent_at=time.time(), running=len(self.flights)))
            except Exception:  # NATS down: the bus reconnects; try again next beat
                log.warning("gateway heartbeat failed")
            if self.kv_copy is not None:
                await self._resync_copy(self.kv_copy)
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def _resync_copy(self, copy: LocalIndex) -> None:
        """Ask the workers this gateway's index copy is behind for their snapshots; forget
        the ones that left."""
        for gone in [w for w in copy.workers if w not in self.registry.workers]:
            copy.forget(gone)
        for worker_id in copy.to_resync(self.live_epochs()):
            try:
                await self._ask_snapshot(worker_id)
            except Exception:  # NATS down: asked again on a later beat
                return

    async def _ask_snapshot(self, worker_id: str) -> None:
        await self.bus.publish(subjects.kv_resync(worker_id),
                               KVResyncRequest(worker_id=worker_id))

    def _on_kv_events(self, message: Message, _ctx: Context) -> None:
        if isinstance(message, KVEvents | KVSnapshot) and self.kv_copy is not None:
            self.kv_copy.apply(message)

    def live_epochs(self) -> dict[str, str]:
        """Live prefill and decode workers -> their current epochs."""
        return {s.worker_id: s.heartbeat.epoch for role in WORKER_ROLES
                for s in self.registry.live(role)}

    async def close(self) -> None:
        for task in (self._heartbeats, self._syncs, self._connecting):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.bus.close()
        if self.kv is not None:
            await self.kv.close()

    def ready(self) -> bool:
        """Connected, with workers to route to; at start, also with the index copy in step
        with them (bounded by COPY_SYNC_GRACE_S: a worker that cannot send its snapshot only
        delays readiness), so that the first requests do not all go to Redis."""
        if not self.bus.connected or not self.registry.live(Role.DECODE):
            return False
        if not self.registry.live(Role.PREFILL) and self.config.local_prefill_threshold <= 0:
            return False
        if self._copy_ready or self.kv_copy is None:
            return True
        now = time.monotonic()
        self._ready_since = self._ready_since or now
        self._copy_ready = not self.kv_copy.behind(self.live_epochs()) or \
            now - self._ready_since > COPY_SYNC_GRACE_S
        return self._copy_ready

    def _on_heartbeat(self, message: Message, _ctx: Context) -> None:
        if isinstance(message, WorkerHeartbeat):
            self.registry.observe(message)
            if message.role in ("prefill", "decode"):
                export_worker_figures(message)
                if self.kv_copy is not None and self.kv_copy.to_resync(
                        {message.worker_id: message.epoch}):  # new here: its snapshot now
                    task = asyncio.ensure_future(self._ask_snapshot(message.worker_id))
                    task.add_done_callback(lambda t: t.exception())  # owned: result observed
            for role in WORKER_ROLES:
                LIVE_WORKERS.labels(role=role).set(len(self.registry.live(role)))

    def _on_inbox(self, message: Message, _ctx: Context) -> None:
        if isinstance(message, TokenDeltas):
            for delta in message.deltas:
                flight = self.flights.get(delta.request_id)
                if flight is not None and (flight.tap is None or not flight.tap(delta)):
                    flight.queue.put_nowait(delta)
        elif isinstance(message, ErrorMessage):
            flight = self.flights.get(message.request_id)
            if flight is not None:
                flight.queue.put_nowait(message)
        elif isinstance(message, ProfileResult):
            waiter = self._profiles.pop(message.request_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(message)

    async def profile(self, worker_id: str, steps: int, timeout_s: float) -> ProfileResult:
        """Ask a live worker to profile its next `steps` steps (for at most timeout_s); its
        ProfileResult, or RequestFailed: unknown worker, or no answer in time."""
        state = self.registry.workers.get(worker_id)
        if state is None or not self.registry.is_live(worker_id) or \
                state.heartbeat.role not in WORKER_ROLES:
            raise RequestFailed(errors.BAD_REQUEST, f"no live prefill or decode worker "
                                f"{worker_id!r}")
        request_id = uuid.uuid4().hex
        waiter: asyncio.Future[ProfileResult] = asyncio.get_running_loop().create_future()
        self._profiles[request_id] = waiter
        subject = (subjects.prefill_worker(worker_id) if state.heartbeat.role == Role.PREFILL
                   else subjects.decode_worker(worker_id))
        try:
            await self.bus.publish(subject, ProfileRequest(
                request_id=request_id, steps=steps, timeout_s=timeout_s,
                reply_subject=self.inbox))
            return await asyncio.wait_for(waiter, timeout_s + PROFILE_GRACE_S)
        except TimeoutError:
            raise RequestFailed(errors.TIMEOUT, f"worker {worker_id} sent no profile within "
                                f"{timeout_s + PROFILE_GRACE_S:g} s") from None
        finally:
            self._profiles.pop(request_id, None)
