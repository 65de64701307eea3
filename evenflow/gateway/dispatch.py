"""Routing and sending one attempt of a request: the KV index asked which workers hold the
prompt's leading blocks (this gateway's copy, or Redis while it is behind), a decode worker with
room (waiting, bounded, while every one is full), a prefill worker or the decode worker's own
prefill, the prediction written back, and the request published; then releasing the workers'
load, counting prefix hits and cancelling an attempt on its workers."""

from __future__ import annotations

import asyncio
import time

from opentelemetry import trace

from evenflow.gateway.fleet import Fleet
from evenflow.gateway.flight import Flight, RequestFailed
from evenflow.gateway.router import WorkerState
from evenflow.proto import errors, subjects
from evenflow.proto.hashing import adapter_salt, chain_hashes
from evenflow.proto.messages import Cancel, DecodeRequest, PrefillRequest, Role
from evenflow.proto.sampling import SamplingParams
from evenflow.services.config import MeshConfig
from evenflow.services.metrics import (
    CACHED_TOKENS,
    KV_INDEX_FALLBACKS,
    KV_LOOKUP_SECONDS,
    KV_LOOKUPS,
    PREDICTED_CACHED_TOKENS,
    PROMPT_TOKENS,
    ROUTE_DECISION_CPU_SECONDS,
    ROUTE_DECISION_SECONDS,
    ROUTING_DECISIONS,
    labelled,
)

ROOM_POLL_S = 0.05  # how often a request waiting for a decode worker with room looks again


class Dispatcher:
    def __init__(self, config: MeshConfig, fleet: Fleet, tracer: trace.Tracer,
                 salt: bytes) -> None:
        self.config, self.fleet, self.tracer, self.salt = config, fleet, tracer, salt

    async def lookup(self, hashes: list[int]) -> tuple[dict[str, float] | None, str]:
        """(worker_id -> cached leading blocks, or None when the index is unusable; where the
        answer came from: local, redis or none)."""
        if self.fleet.kv is None:
            return {}, "none"
        started = time.perf_counter()
        try:
            if self.fleet.kv_copy is not None:
                live = self.fleet.live_epochs()
                if not self.fleet.kv_copy.behind(live):
                    labelled(KV_LOOKUPS, "local").inc()
                    matched = self.fleet.kv_copy.match(hashes, live, self.config.kv_disk_credit)
                    return self.fleet.kv.with_predictions(matched, hashes), "local"
                KV_INDEX_FALLBACKS.labels(reason="behind").inc()
            labelled(KV_LOOKUPS, "redis").inc()
            return await self.fleet.kv.lookup(hashes, self.fleet.registry.epoch_of), "redis"
        finally:
            KV_LOOKUP_SECONDS.observe(time.perf_counter() - started)

    async def wait_for_decode(self, total_blocks: int, matched: dict[str, float],
                               exclude: set[str], flight: Flight,
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
                        if (state := self.fleet.registry.workers.get(w)) and state.seen_at <= at}
            # `exclude` (workers that failed this request) is a preference: with no other
            # worker, the request goes back to one of them (the retries bound how often)
            decode = (self.fleet.registry.pick_decode(total_blocks, matched, exclude | refusing)
                      or self.fleet.registry.pick_decode(total_blocks, matched, refusing))
            if decode is not None:
                flight.no_worker_since = 0.0
                if not flight.refused:
                    flight.admit_by = None  # room at once: a later wait starts afresh
                return decode
            live = self.fleet.registry.live(Role.DECODE)
            could_fit = [s for s in live if s.heartbeat.total_kv_blocks >= total_blocks + 1]
            if not could_fit:
                # a stream moving off a worker that died, with no decode worker live at all
                # (a DEP group re-forming, a lone worker restarting): it waits for one to come
                # back, migration_wait_s at most
                now = time.monotonic()
                if exclude and not live:
                    flight.no_worker_since = flight.no_worker_since or now
                if not live and (not exclude or now - flight.no_worker_since
                                 > self.config.migration_wait_s):
                    waited = f"; waited {now - flight.no_worker_since:.1f} s (migration_wait_s)" \
                        if exclude else ""
                    raise RequestFailed(errors.NO_CAPACITY, f"no decode worker alive{waited}")
                if live:
                    raise RequestFailed(errors.NO_CAPACITY, "no live decode worker has room "
                                        f"for {total_blocks} KV blocks")
            if time.monotonic() >= give_up:
                raise RequestFailed(errors.NO_CAPACITY, "no decode worker had room within "
                                    f"{self.config.queue_timeout_s:g} s")
            slept = time.perf_counter()
            await asyncio.sleep(ROOM_POLL_S)
            flight.waited_s += time.perf_counter() - slept

    async def send(self, request_id: str, flight: Flight, prompt: list[int],
                    spec: SamplingParams, exclude: set[str], force_local: bool,
                    deadline: float | None) -> None:
        """Route the request and publish it; raises RequestFailed when nothing can take it."""
        bs = self.config.block_size
        queued_at = time.monotonic()
        decided, cpu = time.perf_counter(), time.thread_time()
        flight.waited_s = 0.0
        with self.tracer.start_as_current_span("route") as span:
            hashes = chain_hashes(prompt, bs, adapter_salt(self.salt, spec.lora_name)
                                  if spec.lora_name else self.salt)
            total = -(-len(prompt) // bs)
            matched, index_source = await self.lookup(hashes)
            reason = self.config.router if matched is not None else "redis_unavailable"
            matched = matched or {}
            decode = await self.wait_for_decode(total, matched, exclude, flight, deadline)
            span.set_attribute("evenflow.route.queued_s", time.monotonic() - queued_at)
            uncached_local = len(prompt) - matched.get(decode.worker_id, 0) * bs
            threshold = self.config.local_prefill_threshold
            local = force_local or uncached_local < threshold
            prefill = None if local else self.fleet.registry.pick_prefill(total, matched, bs)
            if prefill is None and not local:
                if threshold == 0:
                    raise RequestFailed(errors.NO_CAPACITY, "no prefill worker is live")
                local = True  # no prefill worker: the decode worker prefills
            computing = decode if local else prefill
            assert computing is not None
            labelled(ROUTE_DECISION_SECONDS, index_source).observe(
                time.perf_counter() - decided - flight.waited_s)
            labelled(ROUTE_DECISION_CPU_SECONDS, index_source).observe(
                time.thread_time() - cpu)
            hit = int(matched.get(computing.worker_id, 0))  # (disk blocks count in part)
            if reason == "kv":
                reason = "kv_hit" if hit else "kv_miss"
            labelled(ROUTING_DECISIONS, reason).inc()
            PREDICTED_CACHED_TOKENS.inc(min(hit * bs, len(prompt) - 1))
            # (an engine takes whole blocks before the prompt's last token from its cache)
            flight.expected_cached_tokens = min(hit, (len(prompt) - 1) // bs) * bs
            flight.decode, flight.prefill = decode.worker_id, prefill.worker_id if prefill else None
            flight.prefill_blocks = total - hit
            self.fleet.registry.acquire(decode, prefill, flight.prefill_blocks)
            span.set_attribute("evenflow.route.decode", decode.worker_id)
            span.set_attribute("evenflow.route.prefill", flight.prefill or "local")
            span.set_attribute("evenflow.route.matched_blocks", hit)
            if self.fleet.kv is not None:
                holders = self._holders(matched, decode, prefill)
                self.fleet.kv.predict(hashes, holders)
                self.fleet.peers.routed(hashes, list(holders))
            bus, inbox = self.fleet.bus, self.fleet.inbox
            if prefill is None:
                await bus.publish(subjects.decode_worker(decode.worker_id), DecodeRequest(
                    request_id=request_id, prompt_token_ids=prompt, sampling=spec,
                    reply_subject=inbox, enqueued_at=time.time()))
            else:
                source, source_blocks = self._kv_source(matched, prefill.worker_id, hit)
                await bus.publish(subjects.prefill_worker(prefill.worker_id), PrefillRequest(
                    request_id=request_id, prompt_token_ids=prompt, sampling=spec,
                    reply_subject=inbox, decode_worker=decode.worker_id,
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
                    self.fleet.registry.is_live(worker_id):
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

    def release(self, flight: Flight) -> None:
        self.fleet.registry.release(flight.decode, flight.prefill, flight.prefill_blocks)
        flight.prefill = flight.decode = None
        flight.prefill_blocks = 0

    @staticmethod
    def count_hits(flight: Flight, prompt_tokens: int, cached_tokens: int) -> None:
        """Prefix hit rate per worker that computed the prompt (sum() gives the total)."""
        worker = flight.prefill or flight.decode or "unknown"
        labelled(PROMPT_TOKENS, worker).inc(prompt_tokens)
        labelled(CACHED_TOKENS, worker).inc(cached_tokens)

    def cancel(self, request_id: str, flight: Flight) -> None:
        """Best effort, without waiting: tell the workers to drop the request."""
        for subject in ([subjects.prefill_worker(flight.prefill)] if flight.prefill else []) + (
                [subjects.decode_worker(flight.decode)] if flight.decode else []):
            task = asyncio.ensure_future(
                self.fleet.bus.publish(subject, Cancel(request_id=request_id)))
            task.add_done_callback(lambda t: t.exception())  # owned: result observed

