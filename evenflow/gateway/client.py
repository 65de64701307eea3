"""The gateway's client of the worker fleet: one NATS connection, one listener on this gateway's
inbox demultiplexing TokenDeltas / ErrorMessage to per-request queues, heartbeats into the
worker registry, and `generate()`: route -> send -> yield token ids until finished.

Routing state lives with its owners: predictions in the KV index client, this gateway's
in-flight load in the worker registry. A retryable error (no room, draining) or a worker that
stops heartbeating re-sends the request elsewhere; tokens already streamed are kept: the retry
prefills prompt + those tokens on another decode worker and asks only for the rest. A request
with no progress for stall_timeout_s, or past its deadline, fails with TIMEOUT (and is
cancelled on the workers).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context

from evenflow.gateway.replies import DeltaQueue, Ordering
from evenflow.gateway.router import RouterWeights, WorkerRegistry, WorkerState
from evenflow.gateway.timings import FirstTokenTimings
from evenflow.kv_index.client import KVIndexClient
from evenflow.kv_index.local_copy import LocalIndex
from evenflow.kv_index.store import Keys
from evenflow.proto import errors, subjects
from evenflow.proto.hashing import chain_hashes
from evenflow.proto.messages import (
    WORKER_ROLES,
    Cancel,
    DecodeRequest,
    ErrorMessage,
    KVEvents,
    KVResyncRequest,
    KVSnapshot,
    Message,
    PrefillRequest,
    ProfileRequest,
    ProfileResult,
    Role,
    SamplingSpec,
    TokenDelta,
    TokenDeltas,
    WorkerHeartbeat,
)
from evenflow.services.bus import Bus, MessageBus, NatsAuthError
from evenflow.services.config import MeshConfig
from evenflow.services.metrics import (
    CACHED_TOKENS,
    KV_INDEX_FALLBACKS,
    KV_LOOKUP_SECONDS,
    KV_LOOKUPS,
    LIVE_WORKERS,
    PREDICTED_CACHED_TOKENS,
    PROMPT_TOKENS,
    RETRIES,
    ROUTE_DECISION_CPU_SECONDS,
    ROUTE_DECISION_SECONDS,
    ROUTING_DECISIONS,
    export_worker_figures,
)

log = logging.getLogger(__name__)


ROOM_POLL_S = 0.05  # how often a request waiting for a decode worker with room looks again
PROFILE_GRACE_S = 30.0  # a profile's answer may come this long after its window (trace export)
# at start, readiness waits this long at most for the index copy to hold every worker's snapshot
COPY_SYNC_GRACE_S = 5.0
LOST_IN_OUTAGE_S = 1.0  # after NATS reconnects, silence this long means the request was lost


class RequestFailed(Exception):
    """A request the fleet could not serve; `code` is one of proto.errors."""

    def __init__(self, code: str, description: str) -> None:
        super().__init__(description)
        self.code, self.description = code, description


@dataclass
class _Flight:
    """One request in flight: its reply queue and where it runs now."""

    queue: asyncio.Queue[TokenDelta | ErrorMessage] = field(default_factory=DeltaQueue)
    prefill: str | None = None
    decode: str | None = None
    prefill_blocks: int = 0  # blocks the prefill worker was expected to compute
    # decode workers that refused it for lack of room -> when: not tried again before their
    # next heartbeat (which says whether room came back)
    refused: dict[str, float] = field(default_factory=dict)
    admit_by: float | None = None  # waiting for room since: give up at this time.monotonic()
    waited_s: float = 0.0  # waiting for a decode worker with room (not routing time)
    no_worker_since: float = 0.0  # migrating with no decode worker live, since (monotonic)
    published_at: float = 0.0  # time.perf_counter() when its latest attempt was published
    expected_cached_tokens: int = 0  # what the router expected the computing worker to hold


@dataclass
class Served:
    """Where a request ran, for its log line, as of its first token: the prefill worker ("":
    the decode worker prefilled), the decode worker, and the prompt tokens the router expected
    the worker computing the prompt to find cached (the KV index's match: a shortfall against
    the cached tokens reported is a miss)."""

    prefill: str = ""
    decode: str = ""
    expected_cached_tokens: int = 0

    def workers(self) -> str:
        """e.g. "p0->d0", "d0" (prefilled by the decode worker), "-" (not routed)."""
        return "->".join(w for w in (self.prefill, self.decode) if w) or "-"


class GatewayClient:
    def __init__(self, config: MeshConfig, tracer: trace.Tracer, salt: bytes,
                 bus: MessageBus | None = None) -> None:
        self.config, self.tracer, self.salt = config, tracer, salt
        self.gateway_id = uuid.uuid4().hex[:12]
        self.inbox = subjects.gateway_inbox(self.gateway_id)
        self.bus: MessageBus = bus or Bus(f"gateway-{self.gateway_id}",
                                              config.reassembly_budget())
        self.registry = WorkerRegistry(config.worker_timeout_s, RouterWeights(
            config.router, config.kv_overlap_weight, config.decode_load_weight,
            config.load_cap_blocks, config.router_temperature), own_subject=self.inbox)
        self.kv = KVIndexClient(config.redis_url, Keys(config.redis_prefix),
                                config.kv_lookup_timeout_s, config.prediction_ttl_ms) if (
            config.redis_url and config.router == "kv") else None
        # this gateway's own copy of the index, from the KV-event stream (Redis answers while
        # it is behind)
        self.kv_copy = LocalIndex() if self.kv is not None and config.kv_index_local_copy \
            else None
        self.flights: dict[str, _Flight] = {}
        self._profiles: dict[str, asyncio.Future[ProfileResult]] = {}  # POST /admin/profile
        self._heartbeats: asyncio.Task | None = None
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
            log.warning("NATS unreachable at start (%s); still trying",
                        exc or type(exc).__name__)
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
        for worker_id in copy.to_resync(self._live_epochs()):
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

    def _live_epochs(self) -> dict[str, str]:
        """Live prefill and decode workers -> their current epochs."""
        return {s.worker_id: s.heartbeat.epoch for role in WORKER_ROLES
                for s in self.registry.live(role)}

    async def close(self) -> None:
        for task in (self._heartbeats, self._connecting):
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
        self._copy_ready = not self.kv_copy.behind(self._live_epochs()) or \
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
                if flight is not None:
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

    # -- routing ----------------------------------------------------------------------------
    async def _lookup(self, hashes: list[int]) -> tuple[dict[str, float] | None, str]:
        """(worker_id -> cached leading blocks, or None when the index is unusable; where the
        answer came from: local, redis or none)."""
        if self.kv is None:
            return {}, "none"
        started = time.perf_counter()
        try:
            if self.kv_copy is not None:
                live = self._live_epochs()
                if not self.kv_copy.behind(live):
                    KV_LOOKUPS.labels(source="local").inc()
                    matched = self.kv_copy.match(hashes, live, self.config.kv_disk_credit)
                    return self.kv.with_predictions(matched, hashes), "local"
                KV_INDEX_FALLBACKS.labels(reason="behind").inc()
            KV_LOOKUPS.labels(source="redis").inc()
            return await self.kv.lookup(hashes, self.registry.epoch_of), "redis"
        finally:
            KV_LOOKUP_SECONDS.observe(time.perf_counter() - started)

    async def _wait_for_decode(self, total_blocks: int, matched: dict[str, float],
                               exclude: set[str], flight: _Flight,
                               deadline: float | None) -> WorkerState:
        """A decode worker with room for the prompt. While every live one is full the request
        waits (as in vLLM's waiting queue) for queue_timeout_s at most, then fails with
        NO_CAPACITY (503); at once when no live worker could ever hold the prompt, unless the
        request is moving off a failed worker and no decode worker is live: then it waits
        migration_wait_s for one to come back."""
        if flight.admit_by is None:
            flight.admit_by = time.monotonic() + self.config.queue_timeout_s
        give_up = flight.admit_by if deadline is None else min(flight.admit_by, deadline)
        while True:
            refusing = {w for w, at in flight.refused.items()
                        if (state := self.registry.workers.get(w)) and state.seen_at <= at}
            # `exclude` (workers that failed this request) is a preference: with no other
            # worker, the request goes back to one of them (the retries bound how often)
            decode = (self.registry.pick_decode(total_blocks, matched, exclude | refusing)
                      or self.registry.pick_decode(total_blocks, matched, refusing))
            if decode is not None:
                flight.no_worker_since = 0.0
                if not flight.refused:
                    flight.admit_by = None  # room at once: a later wait starts afresh
                return decode
            live = self.registry.live(Role.DECODE)
            could_fit = [s for s in live if s.heartbeat.total_kv_blocks >= total_blocks + 1]
            if not could_fit:
                # a stream moving off a worker that died, with no decode worker live at all
                # (a DEP group re-forming, a lone worker restarting): it waits for one to come
                # back, migration_wait_s at most
                now = time.monotonic()
                if exclude and not live:
                    flight.no_worker_since = flight.no_worker_since or now
                if not (exclude and not live) or \
                        now - flight.no_worker_since > self.config.migration_wait_s:
                    raise RequestFailed(errors.NO_CAPACITY, "no live decode worker has room "
                                        f"for {total_blocks} KV blocks")
            if time.monotonic() >= give_up:
                raise RequestFailed(errors.NO_CAPACITY, "no decode worker had room within "
                                    f"{self.config.queue_timeout_s:g} s")
            slept = time.perf_counter()
            await asyncio.sleep(ROOM_POLL_S)
            flight.waited_s += time.perf_counter() - slept

    async def _send(self, request_id: str, flight: _Flight, prompt: list[int],
                    spec: SamplingSpec, exclude: set[str], force_local: bool,
                    deadline: float | None) -> None:
        """Route the request and publish it; raises RequestFailed when nothing can take it."""
        bs = self.config.block_size
        queued_at = time.monotonic()
        decided, cpu = time.perf_counter(), time.thread_time()
        flight.waited_s = 0.0
        with self.tracer.start_as_current_span("route") as span:
            hashes = chain_hashes(prompt, bs, self.salt)
            total = -(-len(prompt) // bs)
            matched, index_source = await self._lookup(hashes)
            reason = self.config.router if matched is not None else "redis_unavailable"
            matched = matched or {}
            decode = await self._wait_for_decode(total, matched, exclude, flight, deadline)
            span.set_attribute("evenflow.route.queued_s", time.monotonic() - queued_at)
            uncached_local = len(prompt) - matched.get(decode.worker_id, 0) * bs
            threshold = self.config.local_prefill_threshold
            local = force_local or uncached_local < threshold
            prefill = None if local else self.registry.pick_prefill(total, matched, bs)
            if prefill is None and not local:
                if threshold == 0:
                    raise RequestFailed(errors.NO_CAPACITY, "no prefill worker is live")
                local = True  # no prefill worker: the decode worker prefills
            computing = decode if local else prefill
            assert computing is not None
            ROUTE_DECISION_SECONDS.labels(index=index_source).observe(
                time.perf_counter() - decided - flight.waited_s)
            ROUTE_DECISION_CPU_SECONDS.labels(index=index_source).observe(
                time.thread_time() - cpu)
            hit = int(matched.get(computing.worker_id, 0))  # (disk blocks count in part)
            if reason == "kv":
                reason = "kv_hit" if hit else "kv_miss"
            ROUTING_DECISIONS.labels(reason=reason).inc()
            PREDICTED_CACHED_TOKENS.inc(min(hit * bs, len(prompt) - 1))
            # (an engine takes whole blocks before the prompt's last token from its cache)
            flight.expected_cached_tokens = min(hit, (len(prompt) - 1) // bs) * bs
            flight.decode, flight.prefill = decode.worker_id, prefill.worker_id if prefill else None
            flight.prefill_blocks = total - hit
            self.registry.acquire(decode, prefill, flight.prefill_blocks)
            span.set_attribute("evenflow.route.decode", decode.worker_id)
            span.set_attribute("evenflow.route.prefill", flight.prefill or "local")
            span.set_attribute("evenflow.route.matched_blocks", hit)
            if self.kv is not None:
                self.kv.predict(hashes, self._holders(matched, decode, prefill))
            if prefill is None:
                await self.bus.publish(subjects.decode_worker(decode.worker_id), DecodeRequest(
                    request_id=request_id, prompt_token_ids=prompt, sampling=spec,
                    reply_subject=self.inbox, enqueued_at=time.time()))
            else:
                source, source_blocks = self._kv_source(matched, prefill.worker_id, hit)
                await self.bus.publish(subjects.prefill_worker(prefill.worker_id), PrefillRequest(
                    request_id=request_id, prompt_token_ids=prompt, sampling=spec,
                    reply_subject=self.inbox, decode_worker=decode.worker_id,
                    enqueued_at=time.time(), kv_source=source, kv_source_blocks=source_blocks))
            flight.published_at = time.perf_counter()

    def _kv_source(self, matched: dict[str, float], prefill_id: str, prefill_hit: int
                   ) -> tuple[str, int]:
        """The live worker holding the most of the prompt's leading blocks in RAM beyond what
        the prefill worker holds, when that is at least kv_pull_min_tokens: the prefill worker
        may pull them from it (services/kv_pull.py). ("", 0): none."""
        min_tokens = self.config.kv_pull_min_tokens
        if min_tokens <= 0:
            return "", 0
        best, best_blocks = "", prefill_hit
        for worker_id, blocks in matched.items():
            if worker_id != prefill_id and int(blocks) > best_blocks and \
                    self.registry.is_live(worker_id):
                best, best_blocks = worker_id, int(blocks)
        if not best or (best_blocks - prefill_hit) * self.config.block_size < min_tokens:
            return "", 0
        return best, best_blocks

    @staticmethod
    def _holders(matched: dict[str, float], *workers: WorkerState | None
                 ) -> dict[str, tuple[str, int]]:
        """The workers about to hold the prompt's blocks: (epoch, blocks they already hold)."""
        return {w.worker_id: (w.heartbeat.epoch, int(matched.get(w.worker_id, 0)))
                for w in workers if w is not None}

    def _release(self, flight: _Flight) -> None:
        self.registry.release(flight.decode, flight.prefill, flight.prefill_blocks)
        flight.prefill = flight.decode = None
        flight.prefill_blocks = 0

    @staticmethod
    def _count_hits(flight: _Flight, prompt_tokens: int, cached_tokens: int) -> None:
        """Prefix hit rate per worker that computed the prompt (sum() gives the total)."""
        worker = flight.prefill or flight.decode or "unknown"
        PROMPT_TOKENS.labels(worker=worker).inc(prompt_tokens)
        CACHED_TOKENS.labels(worker=worker).inc(cached_tokens)

    # -- one request ------------------------------------------------------------------------
    async def generate(self, prompt: list[int], spec: SamplingSpec,
                       request_id: str | None = None,
                       deadline: float | Callable[[], float] | None = None,
                       timings: FirstTokenTimings | None = None,
                       served: Served | None = None) -> AsyncIterator[TokenDelta]:
        """Yield the request's deltas until one carries a finish reason. Raises RequestFailed.
        `deadline` (time.monotonic()), or a function giving it (read at every delta: a
        gateway's drain moves it closer): past it the request fails with TIMEOUT, also while
        deltas keep coming. `timings`: marked when its first delta is taken (with when its
        attempt was published). `served`: filled in with where the request ran (its first
        token's attempt)."""
        deadline_of = deadline if callable(deadline) else (lambda: math.inf) \
            if deadline is None else (lambda: deadline)
        request_id = request_id or uuid.uuid4().hex
        # Each attempt has its own id on the wire ("{id}", then "{id}.1", ...), so a worker
        # that still holds an earlier attempt never confuses the two.
        wire_id, attempt = request_id, 0
        ordering = Ordering()
        flight = self.flights[wire_id] = _Flight()
        emitted: list[int] = []
        exclude: set[str] = set()
        retries = self.config.decode_retries
        finished = False
        try:
            await self._send(wire_id, flight, prompt, spec, exclude, False, _finite(deadline_of()))
            last_progress = time.monotonic()
            while True:
                if time.monotonic() > deadline_of():
                    raise RequestFailed(errors.TIMEOUT, "the request's deadline passed")
                held = ordering.next_held(len(emitted))
                item: TokenDelta | ErrorMessage
                try:
                    if held is not None:
                        item = held
                    elif ordering.lost(time.monotonic()):
                        item = ErrorMessage(request_id=wire_id, code=errors.LOST_IN_OUTAGE,
                                            description="a token delta never arrived",
                                            retryable=True)
                    elif not flight.queue.empty():
                        item = flight.queue.get_nowait()
                    else:
                        wait = max(0.0, min(0.25, deadline_of() - time.monotonic()))
                        async with asyncio.timeout(wait):  # (wait_for would start a task)
                            item = await flight.queue.get()
                except TimeoutError:
                    if ordering.held:
                        continue  # waiting for a delta's predecessor: ordering.lost decides
                    dead = [w for w in (flight.prefill, flight.decode)
                            if w and not self.registry.is_live(w)]
                    reconnected = self.bus.last_reconnect_at
                    if dead:
                        item = ErrorMessage(request_id=wire_id, code=errors.WORKER_ERROR,
                                            description=f"worker {dead[0]} stopped responding",
                                            retryable=True)
                    elif last_progress < reconnected < time.monotonic() - LOST_IN_OUTAGE_S:
                        # NATS came back but nothing arrived since: the request or its answer
                        # was lost in the outage. Send it again (same workers may take it).
                        last_progress = time.monotonic()
                        item = ErrorMessage(request_id=wire_id, code=errors.LOST_IN_OUTAGE,
                                            description="lost in a NATS outage", retryable=True)
                    elif time.monotonic() - last_progress > self.config.stall_timeout_s:
                        raise RequestFailed(errors.TIMEOUT, "the request made no progress for "
                                            f"{self.config.stall_timeout_s:g} s") from None
                    else:
                        continue
                if isinstance(item, TokenDelta) and item.first_index >= 0 and item is not held:
                    admitted = ordering.admit(item, len(emitted), time.monotonic())
                    if admitted is None:
                        continue
                    item = admitted
                if isinstance(item, ErrorMessage):
                    # A full decode worker is tried again once it heartbeats again (room may
                    # be back); the wait for room is bounded by queue_timeout_s, not retries.
                    no_room = item.code == errors.NO_CAPACITY and flight.decode is not None
                    # A draining worker is taken out of routing at once; going elsewhere is
                    # not a failure, so it spends no retry (bounded: one per worker).
                    drained = (item.code == errors.DRAINING
                               and self.registry.mark_draining(item.worker_id))
                    if not item.retryable or (retries <= 0 and not no_room and not drained):
                        raise RequestFailed(item.code, item.description)
                    RETRIES.labels(code=item.code).inc()
                    log.info("request %s: %s (%s) after %d tokens; sending it again",
                             request_id, item.code, item.description, len(emitted))
                    if no_room:
                        assert flight.decode is not None
                        flight.refused[flight.decode] = time.monotonic()
                    elif not drained:
                        retries -= 1
                        if flight.decode and item.code != errors.LOST_IN_OUTAGE:
                            exclude.add(flight.decode)  # before _release forgets it: not again
                    self._cancel(wire_id, flight)
                    self._release(flight)
                    self.flights.pop(wire_id, None)
                    attempt += 1
                    ordering.reset(len(emitted))
                    wire_id = f"{request_id}.{attempt}"
                    self.flights[wire_id] = flight
                    remaining = dataclasses.replace(  # (penalties then see the emitted tokens
                        # as prompt: presence/frequency start over, repetition still applies)
                        spec, max_tokens=spec.max_tokens - len(emitted),
                        min_tokens=max(0, spec.min_tokens - len(emitted)),
                        resumed_output_tokens=len(emitted))  # (a grammar consumes them)
                    await self._send(wire_id, flight, prompt + emitted, remaining, exclude,
                                     force_local=bool(emitted),
                                     deadline=_finite(deadline_of()))
                    continue
                last_progress = time.monotonic()
                flight.refused.clear()  # admitted: a later re-send waits for room afresh
                flight.admit_by = None
                if not emitted:
                    if timings is not None:
                        timings.first_delta(flight.published_at, item.queued_s,
                                            item.computed_s)
                    self._count_hits(flight, len(prompt), item.num_cached_tokens)
                    if served is not None:
                        served.prefill, served.decode = flight.prefill or "", flight.decode or ""
                        served.expected_cached_tokens = flight.expected_cached_tokens
                    if flight.prefill:
                        self.registry.prefill_done(flight.prefill, flight.prefill_blocks)
                        flight.prefill_blocks = 0
                emitted.extend(item.token_ids)
                if item.finish_reason is not None:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._cancel(wire_id, flight)
            self._release(flight)
            self.flights.pop(wire_id, None)

    def _cancel(self, request_id: str, flight: _Flight) -> None:
        """Best effort, without waiting: tell the workers to drop the request."""
        for subject in ([subjects.prefill_worker(flight.prefill)] if flight.prefill else []) + (
                [subjects.decode_worker(flight.decode)] if flight.decode else []):
            task = asyncio.ensure_future(self.bus.publish(subject, Cancel(request_id=request_id)))
            task.add_done_callback(lambda t: t.exception())  # owned: result observed


def _finite(deadline: float) -> float | None:
    """A deadline as _send takes it: None for none."""
    return None if math.isinf(deadline) else deadline
