"""The lifecycle every worker shares (prefill, decode, the KV index, the balancer): connect to
NATS, start, publish heartbeats, and on SIGTERM / SIGINT drain (stop taking work, let in-flight
requests finish for a bounded time), then close the connection and flush traces. Outbound
messages go through one sender task (`send`), so event handlers never create unowned tasks.

Prefill and decode workers add an engine on top (services/engine_worker.py).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid

from opentelemetry import trace
from opentelemetry.context import Context
from prometheus_client import start_http_server

from evenflow.proto import subjects
from evenflow.proto.messages import Message, Role, WorkerHeartbeat
from evenflow.services.bus import EXIT_NATS_AUTH, Bus, MessageBus, NatsAuthError
from evenflow.services.config import MeshConfig
from evenflow.services.metrics import watch_loop_lag
from evenflow.services.tracing import setup_tracing, shutdown_tracing

log = logging.getLogger(__name__)


class WorkerService:
    role: Role

    def __init__(self, config: MeshConfig, worker_id: str, bus: MessageBus | None = None) -> None:
        self.config, self.worker_id = config, worker_id
        self.bus: MessageBus = bus or Bus(f"{self.role}-{worker_id}",
                                              config.reassembly_budget())
        self.tracer: trace.Tracer = setup_tracing(f"evenflow-{self.role}", worker_id)
        self.draining = False
        self.epoch = uuid.uuid4().hex[:12]  # this process's generation, for the KV index
        self._owned_tasks: list[asyncio.Task] = []  # cancelled when the worker stops
        self._teardown_step = "not begun"  # where a shutdown is (named in its timeout warning)
        self._outbox: asyncio.Queue[tuple[str, Message, Context | None]] = asyncio.Queue()
        self._stop = asyncio.Event()
        self.started = asyncio.Event()  # connected, subscribed, heartbeating
        self.exit_code = 0  # the process's status once run() returns (run_worker)

    # -- subclass hooks ---------------------------------------------------------------------
    async def start(self) -> None:
        raise NotImplementedError

    def heartbeat(self) -> WorkerHeartbeat:
        """This service's heartbeat; engine workers add their load."""
        return WorkerHeartbeat(worker_id=self.worker_id, role=self.role,
                               model=self.config.model_name, sent_at=time.time(),
                               epoch=self.epoch, draining=self.draining,
                               unhealthy=self.healthy() or "",
                               metrics_port=self.config.metrics_port)

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

    def ready_note(self) -> str:
        """What the ready line adds after "<role> <id> ready" (engine workers: the kernels)."""
        return ""

    def before_beat(self) -> None:
        """Called before each periodic heartbeat (engine workers export their gauges)."""

    async def stop_parts(self) -> None:
        """After shutdown(): the owned tasks cancelled (engine workers stop their engine too)."""
        for task in self._owned_tasks:
            task.cancel()
        await asyncio.gather(*self._owned_tasks, return_exceptions=True)

    # -- plumbing ---------------------------------------------------------------------------
    def send(self, subject: str, message: Message, span_context: Context | None = None) -> None:
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
            self.before_beat()
            await self._beat()
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def _beat(self, timeout_s: float | None = None) -> None:
        """One heartbeat (within timeout_s, if given); never raises (NATS may be down)."""
        try:
            await asyncio.wait_for(self.bus.publish(
                subjects.heartbeat(self.role, self.worker_id), self.heartbeat()), timeout_s)
        except Exception:
            log.warning("heartbeat failed (NATS down?)")

    def request_stop(self) -> None:
        """Begin draining (what SIGTERM does); `run` returns once done."""
        self._stop.set()

    async def run(self, install_signals: bool = True) -> None:
        loop = asyncio.get_running_loop()
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._stop.set)
        assert self.config.nats_url, "nats_url is required"
        if self.config.metrics_port:
            start_http_server(self.config.metrics_port, addr=self.config.metrics_host)
        await self.bus.connect(self.config.nats_url, security=self.config.nats_security())
        await self.start()
        tasks = [asyncio.create_task(self._sender(), name="sender"),
                 asyncio.create_task(self._heartbeats(), name="heartbeats"),
                 asyncio.create_task(watch_loop_lag(), name="loop lag")]
        self.started.set()
        log.info("%s %s ready%s", self.role, self.worker_id, self.ready_note())
        await self._stop.wait()
        self.draining = True  # heartbeats now say so; new work is refused
        await self._beat(timeout_s=1)  # now, not at the next beat: routing stops sooner
        deadline = time.monotonic() + 10
        while self.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        while not self._outbox.empty() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        try:  # bounded: with NATS or Redis gone mid-shutdown, exit anyway
            await asyncio.wait_for(self._teardown(tasks), timeout=10)
        except Exception as exc:
            log.warning("%s %s: shutdown did not finish cleanly (%r, in %s); exiting",
                        self.role, self.worker_id, exc, self._teardown_step)
        shutdown_tracing()

    async def _teardown(self, tasks: list[asyncio.Task]) -> None:
        # Each step is named as it begins: a teardown past its bound says where it stuck.
        self._teardown_step = "cancelling the sender, heartbeats and loop-lag tasks"
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._teardown_step = "shutdown()"
        await self.shutdown()
        self._teardown_step = "stop_parts()"
        await self.stop_parts()
        self._teardown_step = "closing the NATS connection"
        await self.bus.close()
        self._teardown_step = "done"


def run_worker(service: WorkerService) -> None:
    """Entry point of a worker process: uvloop when available, one event loop."""
    if service.config.parent_pid:
        from evenflow.services.launcher import die_with

        die_with(service.config.parent_pid)
    service.config.configure_logging(f"{service.role}/{service.worker_id}")
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        runner(service.run())
    except NatsAuthError as exc:  # said once, and no restart: it would be refused again
        log.error("%s", exc)
        raise SystemExit(EXIT_NATS_AUTH) from None
    if service.exit_code:
        raise SystemExit(service.exit_code)

