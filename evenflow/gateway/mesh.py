"""The gateway's side of the mesh: one NATS connection, one listener on this gateway's inbox
demultiplexing TokenDeltas / ErrorMessage to per-request queues, heartbeats into the worker
registry, and `generate()`: route -> send -> yield token ids until finished.

A retryable error (no room, draining) or a worker that stops heartbeating re-sends the request
elsewhere; tokens already streamed are kept: the retry prefills prompt + those tokens on another
decode worker and asks only for the rest. A request with no progress for request_timeout_s fails.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context

from evenflow.proto import errors, subjects
from evenflow.proto.messages import (
    Cancel, DecodeRequest, ErrorMessage, Message, PrefillRequest, SamplingSpec, TokenDelta,
    TokenDeltas, WorkerHeartbeat)
from evenflow.services.bus import Bus
from evenflow.services.config import MeshConfig
from evenflow.services.metrics import LIVE_WORKERS
from evenflow.gateway.router import WorkerRegistry


class MeshError(Exception):
    def __init__(self, code: str, description: str) -> None:
        super().__init__(description)
        self.code, self.description = code, description


@dataclass
class _Flight:
    queue: asyncio.Queue[TokenDelta | ErrorMessage] = field(default_factory=asyncio.Queue)
    prefill: str | None = None
    decode: str | None = None


class Mesh:
    def __init__(self, config: MeshConfig, tracer: trace.Tracer) -> None:
        self.config, self.tracer = config, tracer
        self.gateway_id = uuid.uuid4().hex[:12]
        self.inbox = subjects.gateway_inbox(self.gateway_id)
        self.bus = Bus(f"gateway-{self.gateway_id}")
        self.registry = WorkerRegistry(config.worker_timeout_s)
        self.flights: dict[str, _Flight] = {}

    async def start(self) -> None:
        assert self.config.nats_url, "nats_url is required"
        await self.bus.connect(self.config.nats_url)
        await self.bus.subscribe(self.inbox, self._on_inbox)
        await self.bus.subscribe(subjects.HEARTBEAT, self._on_heartbeat)

    async def close(self) -> None:
        await self.bus.close()

    def ready(self) -> bool:
        if not self.bus.connected or not self.registry.live("decode"):
            return False
        return bool(self.registry.live("prefill")) or self.config.local_prefill_threshold > 0

    def _on_heartbeat(self, message: Message, _ctx: Context) -> None:
        if isinstance(message, WorkerHeartbeat):
            self.registry.observe(message)
            for role in ("prefill", "decode"):
                LIVE_WORKERS.labels(role=role).set(len(self.registry.live(role)))

    def _on_inbox(self, message: Message, _ctx: Context) -> None:
        if isinstance(message, TokenDeltas):
            for delta in message.deltas:
                flight = self.flights.get(delta.request_id)
                if flight is not None:
                    flight.queue.put_nowait(delta)
        elif isinstance(message, ErrorMessage):
            flight = self.flights.get(message.request_id)
            if flight is not None:
                flight.queue.put_nowait(message)

    # -- one request ------------------------------------------------------------------------
    async def _send(self, request_id: str, flight: _Flight, prompt: list[int],
                    spec: SamplingSpec, exclude: set[str], force_local: bool) -> None:
        bs = self.config.block_size
        with self.tracer.start_as_current_span("route") as span:
            decode = self.registry.pick_decode(-(-(len(prompt) + 1) // bs), exclude)
            if decode is None:
                raise MeshError(errors.NO_CAPACITY, "no decode worker has room")
            local = force_local or (0 < len(prompt) < self.config.local_prefill_threshold)
            prefill = None if local else self.registry.pick_prefill(len(prompt), bs)
            if prefill is None and not local:
                if self.config.local_prefill_threshold == 0:
                    raise MeshError(errors.NO_CAPACITY, "no prefill worker is live")
                local = True  # no prefill worker: the decode worker prefills
            flight.decode = decode.heartbeat.worker_id
            flight.prefill = prefill.heartbeat.worker_id if prefill else None
            decode.inflight += 1
            if prefill:
                prefill.inflight += 1
            span.set_attribute("evenflow.route.decode", flight.decode)
            span.set_attribute("evenflow.route.prefill", flight.prefill or "local")
            if local:
                await self.bus.publish(subjects.decode_worker(flight.decode), DecodeRequest(
                    request_id, prompt, spec, self.inbox, time.time()))
            else:
                await self.bus.publish(subjects.prefill_worker(flight.prefill), PrefillRequest(
                    request_id, prompt, spec, self.inbox, flight.decode, time.time()))

    def _release(self, flight: _Flight) -> None:
        for worker_id in (flight.prefill, flight.decode):
            state = self.registry.workers.get(worker_id or "")
            if state is not None and state.inflight > 0:
                state.inflight -= 1

    async def generate(self, prompt: list[int], spec: SamplingSpec,
                       request_id: str | None = None) -> AsyncIterator[TokenDelta]:
        """Yield the request's deltas until one carries a finish reason. Raises MeshError."""
        request_id = request_id or uuid.uuid4().hex
        flight = self.flights[request_id] = _Flight()
        emitted: list[int] = []
        exclude: set[str] = set()
        retries = self.config.decode_retries
        finished = False
        try:
            await self._send(request_id, flight, prompt, spec, exclude, False)
            last_progress = time.monotonic()
            while True:
                try:
                    item = await asyncio.wait_for(flight.queue.get(), timeout=0.5)
                except TimeoutError:
                    dead = [w for w in (flight.prefill, flight.decode)
                            if w and not self.registry.is_live(w)]
                    if dead:
                        item = ErrorMessage(request_id, errors.WORKER_ERROR,
                                            f"worker {dead[0]} stopped responding", True)
                    elif time.monotonic() - last_progress > self.config.request_timeout_s:
                        raise MeshError(errors.WORKER_ERROR, "request timed out") from None
                    else:
                        continue
                if isinstance(item, ErrorMessage):
                    if not item.retryable or retries <= 0:
                        raise MeshError(item.code, item.description)
                    retries -= 1
                    self._cancel(request_id, flight)
                    self._release(flight)
                    if flight.decode:
                        exclude.add(flight.decode)
                    remaining = dataclasses.replace(spec, max_tokens=spec.max_tokens - len(emitted))
                    await self._send(request_id, flight, prompt + emitted, remaining, exclude,
                                     force_local=bool(emitted))
                    continue
                last_progress = time.monotonic()
                emitted.extend(item.token_ids)
                if item.finish_reason is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._cancel(request_id, flight)
            self._release(flight)
            self.flights.pop(request_id, None)

    def _cancel(self, request_id: str, flight: _Flight) -> None:
        """Best effort, without waiting: tell the workers to drop the request."""
        for subject in ([subjects.prefill_worker(flight.prefill)] if flight.prefill else []) + (
                [subjects.decode_worker(flight.decode)] if flight.decode else []):
            task = asyncio.ensure_future(self.bus.publish(subject, Cancel(request_id)))
            task.add_done_callback(lambda t: t.exception())  # owned: result observed
