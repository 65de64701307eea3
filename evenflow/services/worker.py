"""The lifecycle every worker shares: connect to NATS, start, publish heartbeats with load, and
on SIGTERM / SIGINT drain (stop taking work, let in-flight requests finish for a bounded time),
then close the connection and flush traces.

Outbound messages go through one sender task (`send`), so callbacks arriving from the engine
thread never create unowned tasks.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

from opentelemetry import trace

from evenflow.proto import subjects
from evenflow.proto.messages import (
    ExpertLoad,
    ExpertPlacement,
    KVEvent,
    KVEvents,
    KVSnapshot,
    Message,
    WorkerHeartbeat,
)
from evenflow.services.bus import Bus
from evenflow.services.config import MeshConfig
from evenflow.services.engine_thread import EngineThread
from evenflow.services.tracing import setup_tracing, shutdown_tracing

log = logging.getLogger(__name__)


class WorkerService:
    role = "worker"

    def __init__(self, config: MeshConfig, worker_id: str) -> None:
        self.config, self.worker_id = config, worker_id
        self.bus = Bus(f"{self.role}-{worker_id}")
        self.tracer: trace.Tracer = setup_tracing(f"evenflow-{self.role}")
        self.draining = False
        self.epoch = uuid.uuid4().hex[:12]  # this process's generation, for the KV index
        self.kv_seq = 0  # KVEvents published so far in this epoch
        self.engine: Any = None
        self.thread: EngineThread | None = None
        self._outbox: asyncio.Queue[tuple[str, Message, object]] = asyncio.Queue()
        self._stop = asyncio.Event()
        self.started = asyncio.Event()  # connected, subscribed, heartbeating

    # -- subclass hooks ---------------------------------------------------------------------
    async def start(self) -> None:
        raise NotImplementedError

    def heartbeat(self) -> WorkerHeartbeat:
        raise NotImplementedError

    def busy(self) -> bool:
        return False

    def healthy(self) -> str | None:
        """Why this service cannot do its job right now (None: it can). NATS is checked by
        the caller; services that need more (Redis) say so here."""
        return None

    def autoscaling_stats(self) -> dict[str, float]:
        """This replica's load signal for an autoscaler (Ray Serve custom metrics)."""
        return {}

    async def shutdown(self) -> None:
        pass

    # -- the engine and its KV events -------------------------------------------------------
    async def serve_engine(self, engine: Any, on_outputs: Callable[[list[Any]], None]) -> None:
        """Run `engine` on its own thread and answer the KV index's resync requests. The engine
        must have been built with `kv_event_listener=self.kv_listener`."""
        self.loop = asyncio.get_running_loop()
        self.engine = engine
        self.thread = EngineThread(engine, self.loop, on_outputs)
        self.thread.start()
        await self.bus.subscribe(subjects.kv_resync(self.worker_id), self._on_resync)
        if getattr(engine, "uses_placement", False):
            await self.bus.subscribe(subjects.EXPERT_PLACEMENT, self._on_placement)
            self._eplb_task = asyncio.create_task(self._report_expert_load(), name="eplb")

    # -- expert placement -------------------------------------------------------------------
    def _on_placement(self, message: Message, _ctx: object) -> None:
        if not isinstance(message, ExpertPlacement) or self.thread is None:
            return
        if message.version == self.engine.placement_version:
            return  # a periodic re-announcement of what we run
        started = time.monotonic()

        def apply() -> None:  # on the engine thread, at a step boundary
            try:
                self.engine.apply_placement_rows(message.version, message.phy2log,
                                                 message.shares)
            except (AssertionError, RuntimeError, ValueError) as exc:
                log.warning("placement %d not applied: %s", message.version, exc)
                return
            log.info("placement %d applied in %.1f ms", message.version,
                     (time.monotonic() - started) * 1e3)

        self.thread.submit(apply)

    async def _report_expert_load(self) -> None:
        while True:
            await asyncio.sleep(self.config.eplb_report_interval_s)
            assert self.thread is not None

            def take() -> None:  # on the engine thread
                layers, slots, counts = self.engine.take_slot_counts_rows()
                version = self.engine.placement_version
                self.loop.call_soon_threadsafe(self.send, subjects.EXPERT_LOAD, ExpertLoad(
                    self.worker_id, version, layers, slots, counts))

            self.thread.submit(take)

    def kv_listener(self, events: list[KVEvent]) -> None:
        """Called on the engine thread after each step with the cache's changes."""
        self.loop.call_soon_threadsafe(self._publish_kv_events, events)

    def _publish_kv_events(self, events: list[KVEvent]) -> None:
        self.kv_seq += 1
        self.send(subjects.KV_EVENTS, KVEvents(self.worker_id, self.role, self.epoch,
                                               self.kv_seq, events))

    def _on_resync(self, _message: Message, _ctx: object) -> None:
        assert self.thread is not None

        def snapshot() -> None:  # on the engine thread, between steps
            hashes = self.engine.blocks.cached_hashes()
            self.loop.call_soon_threadsafe(self._send_snapshot, hashes)

        self.thread.submit(snapshot)

    def _send_snapshot(self, hashes: list[int]) -> None:
        self.send(subjects.KV_EVENTS, KVSnapshot(self.worker_id, self.role, self.epoch,
                                                 self.kv_seq, hashes))

    # -- plumbing ---------------------------------------------------------------------------
    def send(self, subject: str, message: Message, span_context: object = None) -> None:
        """Queue a message for the sender task; `span_context` is the trace context to carry."""
        self._outbox.put_nowait((subject, message, span_context))

    async def _sender(self) -> None:
        from opentelemetry import context as otel_context

        while True:
            subject, message, ctx = await self._outbox.get()
            token = otel_context.attach(ctx) if ctx is not None else None
            try:
                await self.bus.publish(subject, message)
            except Exception:
                log.exception("publish to %s failed", subject)
            finally:
                if token is not None:
                    otel_context.detach(token)

    async def _heartbeats(self) -> None:
        while True:
            try:
                await self.bus.publish(subjects.HEARTBEAT, self.heartbeat())
            except Exception:
                log.warning("heartbeat failed (NATS down?)")
            await asyncio.sleep(self.config.heartbeat_interval_s)

    def request_stop(self) -> None:
        """Begin draining (what SIGTERM does); `run` returns once done."""
        self._stop.set()

    async def run(self, install_signals: bool = True) -> None:
        loop = asyncio.get_running_loop()
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._stop.set)
        assert self.config.nats_url, "nats_url is required"
        await self.bus.connect(self.config.nats_url)
        await self.start()
        tasks = [asyncio.create_task(self._sender(), name="sender"),
                 asyncio.create_task(self._heartbeats(), name="heartbeats")]
        self.started.set()
        log.info("%s %s ready", self.role, self.worker_id)
        await self._stop.wait()
        self.draining = True  # heartbeats now say so; new work is refused
        deadline = time.monotonic() + 10
        while self.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        while not self._outbox.empty() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        try:  # bounded: with NATS or Redis gone mid-shutdown, exit anyway
            await asyncio.wait_for(self._teardown(tasks), timeout=10)
        except Exception as exc:
            log.warning("%s %s: shutdown did not finish cleanly (%r); exiting", self.role,
                        self.worker_id, exc)
        shutdown_tracing()

    async def _teardown(self, tasks: list[asyncio.Task]) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.shutdown()
        if getattr(self, "_eplb_task", None) is not None:
            self._eplb_task.cancel()
        if self.thread is not None:
            self.thread.stop()
        await self.bus.close()

    def now(self) -> float:
        return time.time()


def run_worker(service: WorkerService) -> None:
    """Entry point of a worker process: uvloop when available, one event loop."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        import uvloop
    except ImportError:
        asyncio.run(service.run())
    else:
        uvloop.run(service.run())
