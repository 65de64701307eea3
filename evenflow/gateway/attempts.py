"""One request's flight through the fleet, attempt after attempt, as an async iterator of its
token deltas (`Attempts.deltas`).

An attempt is routed and published by the dispatcher (dispatch.py) under its own wire id
("{id}", then "{id}.1", ...), so a worker that still holds an earlier attempt never confuses
the two. Deltas are delivered in order (replies.Ordering holds one that overtook its
predecessor). A retryable error — no room, a draining worker, a worker that stops
heartbeating, a delta or request lost in a NATS outage — sends the request elsewhere; tokens
already streamed are kept: the retry prefills prompt + those tokens and asks only for the
rest. A request with no progress for stall_timeout_s, or past its deadline, fails with
TIMEOUT, and every ending attempt is cancelled on its workers and its load released."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import AsyncGenerator, Callable

from evenflow.gateway.dispatch import Dispatcher
from evenflow.gateway.fleet import Fleet
from evenflow.gateway.flight import Flight, RequestFailed, Served
from evenflow.gateway.replies import Ordering
from evenflow.gateway.timings import FirstTokenTimings
from evenflow.proto import errors
from evenflow.proto.messages import ErrorMessage, TokenDelta
from evenflow.proto.sampling import SamplingParams
from evenflow.services.metrics import RETRIES

log = logging.getLogger(__name__)

LOST_IN_OUTAGE_S = 1.0  # after NATS reconnects, silence this long means the request was lost
# after a worker of the attempt comes back from being cut off from the bus (its heartbeats
# stopped and resumed), silence this long means the request or its answer was lost with it
LOST_AT_WORKER_S = 3.0
# ... and a request sent this soon after it came back counts too: the bus may not yet carry its
# subjects again (a reconnect's subscriptions, a route's interest) when its heartbeats do
RESUME_SETTLE_S = 2.0


class Attempts:
    def __init__(self, fleet: Fleet, dispatch: Dispatcher, prompt: list[int],
                 spec: SamplingParams, request_id: str, deadline_of: Callable[[], float],
                 timings: FirstTokenTimings | None, served: Served | None) -> None:
        self.fleet, self.dispatch = fleet, dispatch
        self.prompt, self.spec, self.request_id = prompt, spec, request_id
        self.deadline_of, self.timings, self.served = deadline_of, timings, served
        self.wire_id, self.attempt = request_id, 0
        self.ordering = Ordering()
        self.flight = Flight()
        self.emitted: list[int] = []
        self.exclude: set[str] = set()  # decode workers that failed it: not again if others
        self.retries = fleet.config.decode_retries
        self.last_progress = 0.0
        # the direct path (gateway/direct.py): takes an in-order middle delta, or refuses it
        # with nothing changed
        self.direct: Callable[[TokenDelta, float], bool] | None = None

    async def deltas(self) -> AsyncGenerator[TokenDelta]:
        """The request's deltas until one carries a finish reason. Raises RequestFailed."""
        finished = False
        self.fleet.flights[self.wire_id] = self.flight
        if self.direct is not None:
            self.flight.tap = self.offer
        try:
            await self.dispatch.send(self.wire_id, self.flight, self.prompt, self.spec,
                                     self.exclude, False, _finite(self.deadline_of()))
            self.last_progress = time.monotonic()
            while True:
                item = await self._next()
                if item is None:
                    continue
                if isinstance(item, ErrorMessage):
                    await self._send_again(item)
                    continue
                self._progress(item)
                self.emitted.extend(item.token_ids)
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            self.flight.tap = None
            if not finished:
                self.dispatch.cancel(self.wire_id, self.flight)
            self.dispatch.release(self.flight)
            self.fleet.flights.pop(self.wire_id, None)

    def offer(self, delta: TokenDelta) -> bool:
        """The inbox's offer of a delta, before it queues it: True when the direct path
        streamed it. Only a delta of the current attempt, next in order, after the first and
        before the last, with nothing waiting before it and the deadline not passed, while
        the request's task sleeps (it takes what waits in the queue first)."""
        direct, flight, emitted = self.direct, self.flight, self.emitted
        if (direct is None or not emitted or delta.finish_reason is not None
                or delta.request_id != self.wire_id or self.ordering.held
                or delta.first_index != len(emitted) - self.ordering.base
                or not flight.queue.empty()):
            return False
        now = time.monotonic()
        if now > self.deadline_of() or not direct(delta, now):
            return False
        self.last_progress = now  # as _progress does for a delta after the first
        if flight.refused:
            flight.refused.clear()
        flight.admit_by = None
        emitted.extend(delta.token_ids)
        return True

    async def _next(self) -> TokenDelta | ErrorMessage | None:
        """The next delta in order, or an error (a worker's, or one standing for a dead worker
        or a lost delta); None: nothing to act on yet. Raises RequestFailed past the deadline
        or after a stall."""
        if time.monotonic() > self.deadline_of():
            raise RequestFailed(errors.TIMEOUT, "the request's deadline passed")
        held = self.ordering.next_held(len(self.emitted))
        queue = self.flight.queue
        item: TokenDelta | ErrorMessage
        try:
            if held is not None:
                item = held
            elif self.ordering.lost(time.monotonic()):
                item = ErrorMessage(request_id=self.wire_id, code=errors.LOST_IN_OUTAGE,
                                    description="a token delta never arrived", retryable=True)
            elif not queue.empty():
                item = queue.get_nowait()
            else:
                wait = max(0.0, min(0.25, self.deadline_of() - time.monotonic()))
                async with asyncio.timeout(wait):  # (wait_for would start a task)
                    item = await queue.get()
        except TimeoutError:
            if self.ordering.held:
                return None  # waiting for a delta's predecessor: ordering.lost decides
            return self._silence()
        if isinstance(item, TokenDelta) and item.first_index >= 0 and item is not held:
            return self.ordering.admit(item, len(self.emitted), time.monotonic())
        return item

    def _silence(self) -> ErrorMessage | None:
        """Nothing came for a while: an error if a worker of the attempt died or NATS came back
        with nothing since; RequestFailed after stall_timeout_s without progress."""
        flight, now = self.flight, time.monotonic()
        dead = [w for w in (flight.prefill, flight.decode)
                if w and not self.fleet.registry.is_live(w)]
        if dead:
            return ErrorMessage(request_id=self.wire_id, code=errors.WORKER_ERROR,
                                description=f"worker {dead[0]} stopped responding",
                                retryable=True)
        if self.last_progress < self.fleet.bus.last_reconnect_at < now - LOST_IN_OUTAGE_S:
            # NATS came back but nothing arrived since: the request or its answer was lost in
            # the outage. Send it again (the same workers may take it).
            self.last_progress = now
            return ErrorMessage(request_id=self.wire_id, code=errors.LOST_IN_OUTAGE,
                                description="lost in a NATS outage", retryable=True)
        cut_off = [(self.fleet.registry.resumed_at(w), w) for w in (flight.prefill, flight.decode)
                   if w]
        resumed, worker = max(cut_off, default=(0.0, ""))
        if resumed and self.last_progress < resumed + RESUME_SETTLE_S and \
                max(resumed, self.last_progress) < now - LOST_AT_WORKER_S:
            # (the gateway's own connection stayed up: a NATS node or a link on the worker's
            # side; what was published to it meanwhile is gone, and nothing says so)
            self.last_progress = now
            return ErrorMessage(request_id=self.wire_id, code=errors.LOST_IN_OUTAGE,
                                description=f"lost while {worker} was cut off from the bus",
                                retryable=True)
        stall = self.fleet.config.stall_timeout_s
        if now - self.last_progress > stall:
            raise RequestFailed(errors.TIMEOUT, f"the request made no progress for {stall:g} s")
        return None

    async def _send_again(self, item: ErrorMessage) -> None:
        """The attempt failed: a new one elsewhere, or RequestFailed when the error is final or
        the retries are spent."""
        flight = self.flight
        # A full decode worker is tried again once it heartbeats again (room may be back); the
        # wait for room is bounded by queue_timeout_s, not retries.
        no_room = item.code == errors.NO_CAPACITY and flight.decode is not None
        # A draining worker is taken out of routing at once; going elsewhere is not a failure,
        # so it spends no retry (bounded: one per worker).
        drained = item.code == errors.DRAINING and \
            self.fleet.registry.mark_draining(item.worker_id)
        # A worker that switched role handed it back: the same, but the worker is not taken
        # out (its heartbeats say which role it serves; it may have said so already).
        drained = drained or item.code == errors.ROLE_SWITCHED
        if not item.retryable or (self.retries <= 0 and not no_room and not drained):
            raise RequestFailed(item.code, item.description)
        RETRIES.labels(code=item.code).inc()
        log.info("request %s: %s (%s) after %d tokens; sending it again",
                 self.request_id, item.code, item.description, len(self.emitted))
        if no_room:
            assert flight.decode is not None
            flight.refused[flight.decode] = time.monotonic()
        elif not drained:
            self.retries -= 1
            if flight.decode and item.code != errors.LOST_IN_OUTAGE:
                self.exclude.add(flight.decode)  # before release forgets it: not again
        if flight.decode and self.emitted:
            # (moving off a batch-invariant worker: to one of the same numerics if one is live)
            self.exclude |= self.fleet.registry.other_numerics(flight.decode)
        self.dispatch.cancel(self.wire_id, flight)
        self.dispatch.release(flight)
        self.fleet.flights.pop(self.wire_id, None)
        self.attempt += 1
        self.ordering.reset(len(self.emitted))
        self.wire_id = f"{self.request_id}.{self.attempt}"
        self.fleet.flights[self.wire_id] = flight
        done = len(self.emitted)
        remaining = dataclasses.replace(  # (penalties then see the emitted tokens as prompt:
            # presence/frequency start over, repetition still applies)
            self.spec, max_tokens=self.spec.max_tokens - done,
            min_tokens=max(0, self.spec.min_tokens - done),
            resumed_output_tokens=done)  # (a grammar consumes them)
        await self.dispatch.send(self.wire_id, flight, self.prompt + self.emitted, remaining,
                                 self.exclude, force_local=bool(self.emitted),
                                 deadline=_finite(self.deadline_of()))

    def _progress(self, delta: TokenDelta) -> None:
        """A delta arrived: the stall clock restarts; the first one is timed, counted and
        frees the prefill worker's share of the load."""
        flight = self.flight
        self.last_progress = time.monotonic()
        flight.refused.clear()  # admitted: a later re-send waits for room afresh
        flight.admit_by = None
        if self.emitted:
            return
        if self.timings is not None:
            self.timings.first_delta(flight.published_at, delta.queued_s, delta.computed_s)
        self.dispatch.count_hits(flight, len(self.prompt), delta.num_cached_tokens)
        if self.served is not None:
            self.served.prefill, self.served.decode = flight.prefill or "", flight.decode or ""
            self.served.expected_cached_tokens = flight.expected_cached_tokens
        if flight.prefill:
            self.fleet.registry.prefill_done(flight.prefill, flight.prefill_blocks)
            flight.prefill_blocks = 0


def _finite(deadline: float) -> float | None:
    """A deadline as the dispatcher takes it: None for none."""
    return None if math.isinf(deadline) else deadline


def deadline_function(deadline: float | Callable[[], float] | None) -> Callable[[], float]:
    """A deadline (time.monotonic()), a function giving it, or none, as a function."""
    if callable(deadline):
        return deadline
    return (lambda: math.inf) if deadline is None else (lambda: deadline)
