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

from opentelemetry import trace

from evenflow.proto import subjects
from evenflow.proto.messages import Message, WorkerHeartbeat
from evenflow.services.bus import Bus
from evenflow.services.config import MeshConfig
from evenflow.services.tracing import setup_tracing, shutdown_tracing

log = logging.getLogger(__name__)


class WorkerService:
    role = "worker"

    def __init__(self, config: MeshConfig, worker_id: str) -> None:
        self.config, self.worker_id = config, worker_id
        self.bus = Bus(f"{self.role}-{worker_id}")
        self.tracer: trace.Tracer = setup_tracing(f"evenflow-{self.role}")
        self.draining = False
        self._outbox: asyncio.Queue[tuple[str, Message, object]] = asyncio.Queue()
        self._stop = asyncio.Event()

    # -- subclass hooks ---------------------------------------------------------------------
    async def start(self) -> None:
        raise NotImplementedError

    def heartbeat(self) -> WorkerHeartbeat:
        raise NotImplementedError

    def busy(self) -> bool:
        return False

    async def shutdown(self) -> None:
        pass

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

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        assert self.config.nats_url, "nats_url is required"
        await self.bus.connect(self.config.nats_url)
        await self.start()
        tasks = [asyncio.create_task(self._sender(), name="sender"),
                 asyncio.create_task(self._heartbeats(), name="heartbeats")]
        log.info("%s %s ready", self.role, self.worker_id)
        await self._stop.wait()
        self.draining = True  # heartbeats now say so; new work is refused
        deadline = time.monotonic() + 10
        while self.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        while not self._outbox.empty() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.shutdown()
        await self.bus.close()
        shutdown_tracing()

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
