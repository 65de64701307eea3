"""Decode worker: KV blocks in -> admitted into the paged cache -> continuous batching -> token
ids back to each gateway, one TokenDeltas message per gateway per engine step.

Data flow: receive KV chunks -> reassemble (proto/kv_handoff.py) -> admit (engine thread imports
the blocks) -> schedule -> forward -> sample -> emit deltas.

Also serves DecodeRequest (short prompts prefilled here: conditional disaggregation). A chunk that
arrives out of order or twice fails its request; a request that does not fit is rejected with a
retryable NO_CAPACITY error, and the gateway tries another worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace

from opentelemetry import trace
from opentelemetry.context import Context

from evenflow.engine import build_engine
from evenflow.proto import errors, kv_handoff
from evenflow.proto.messages import (
    Cancel,
    DecodeRequest,
    ErrorMessage,
    KVBlockChunk,
    KVTransferComplete,
    Message,
    ProfileRequest,
    Role,
    TokenDelta,
    TokenDeltas,
    WorkerHeartbeat,
)
from evenflow.proto.sampling import SamplingParams
from evenflow.services.engine_api import logprob_fields
from evenflow.services.engine_thread import (
    Abort,
    AddPrefilled,
    AddRequest,
    Admitted,
    EngineCommand,
    Rejected,
    StepDone,
    StepFailed,
    first_token_times,
)
from evenflow.services.engine_worker import EngineWorker
from evenflow.services.metrics import KV_TRANSFER_BYTES


@dataclass
class _Transfer:
    """One request's KV chunks as they arrive."""

    started: float
    span: trace.Span
    assembler: kv_handoff.Assembler = field(default_factory=kv_handoff.Assembler)


@dataclass
class _Active:
    reply_subject: str
    span: trace.Span  # decode.generate
    blocks: int  # KV blocks promised until the engine admits it
    queue_span: trace.Span | None = None
    sent: int = 0  # output tokens of the request already sent (the prefill worker's first: 1)
    received_ns: int = field(default_factory=time.time_ns)  # (clock of Admitted.at_ns)
    admitted_ns: int = 0
    priority: int = 0  # SamplingParams.priority (lower is sooner)


class DecodeWorker(EngineWorker):
    role = Role.DECODE

    handlers = {"decode": "_on_request", "kv_transfer": "_on_transfer"}

    async def start(self) -> None:
        engine = build_engine(**self.engine_build_args())
        self.take_role()
        await self.serve_engine(engine)
        await self.subscribe_role_subjects()

    def take_role(self) -> None:
        self.transfers: dict[str, _Transfer] = {}
        self.active: dict[str, _Active] = {}
        # (cumulative over the worker's life: kept through switches)
        self.kv_bytes_received: int = getattr(self, "kv_bytes_received", 0)
        self.kv_transfer_seconds: float = getattr(self, "kv_transfer_seconds", 0.0)
        self._sweeper = asyncio.create_task(self._sweep_transfers(), name="sweep transfers")

    def leave_role(self) -> None:
        self._sweeper.cancel()

    def hand_back(self) -> int:
        """Streams still running when a switch's drain bound passed: aborted here, each one's
        gateway told to retry it elsewhere (it continues from what was streamed: migration)."""
        handed = list(self.active)
        for request_id in handed:
            active = self.active.pop(request_id)
            if active.queue_span is not None:
                active.queue_span.end()
            active.span.end()
            self.engine_thread.submit(Abort(request_id))
            self._error(active.reply_subject, request_id, errors.ROLE_SWITCHED,
                        "decode worker is switching role", None)
        for transfer in self.transfers.values():
            transfer.span.end()
        self.transfers.clear()
        return len(handed)

    def heartbeat(self) -> WorkerHeartbeat:
        return dataclasses.replace(
            super().heartbeat(), running=self.engine.num_running,
            waiting=self.engine.num_waiting, free_kv_blocks=self._free_blocks(),
            total_kv_blocks=self.engine.layout.num_kv_blocks,
            kv_bytes_received=self.kv_bytes_received,
            kv_transfer_seconds=self.kv_transfer_seconds,
            load_by_gateway=dict(Counter(a.reply_subject for a in self.active.values())))

    def busy(self) -> bool:
        return bool(self.active or self.transfers)

    def load_stats(self) -> dict[str, float]:
        return {"running_sequences": float(self.engine.num_running + self.engine.num_waiting),
                "free_kv_fraction": self._free_blocks() / max(1, self.engine.layout.num_kv_blocks)}

    async def shutdown(self) -> None:
        self.leave_role()

    def _free_blocks(self) -> int:
        """Free blocks less those promised to requests not yet admitted by the engine."""
        return self.engine.num_free_kv_blocks - sum(
            a.blocks for a in self.active.values() if a.blocks)

    # -- inbound ----------------------------------------------------------------------------
    def _on_transfer(self, message: Message, ctx: Context) -> None:
        """From prefill workers: a request's K/V, then its completion."""
        if isinstance(message, KVBlockChunk):
            self._on_chunk(message, ctx)
        elif isinstance(message, KVTransferComplete):
            self._on_complete(message, ctx)

    def _on_request(self, message: Message, ctx: Context) -> None:
        """From gateways: requests prefilled here, and cancellations."""
        if isinstance(message, DecodeRequest):
            self._admit(message.request_id, message.prompt_token_ids, message.sampling,
                        message.reply_subject, ctx, None)
        elif isinstance(message, Cancel):
            self.transfers.pop(message.request_id, None)
            if message.request_id in self.active:
                self.engine_thread.submit(Abort(message.request_id))
        elif isinstance(message, ProfileRequest):
            self.start_profile(message)

    def drop_requests_of(self, reply_subjects: set[str]) -> int:
        orphans = [r for r, a in self.active.items() if a.reply_subject in reply_subjects]
        for request_id in orphans:
            active = self.active.pop(request_id)
            if active.queue_span is not None:
                active.queue_span.end()
            active.span.end()
            self.engine_thread.submit(Abort(request_id))
        return len(orphans)

    def _on_chunk(self, chunk: KVBlockChunk, ctx: Context) -> None:
        transfer = self.transfers.get(chunk.request_id)
        if transfer is None:
            span = self.tracer.start_span("decode.kv_receive", context=ctx)
            transfer = self.transfers[chunk.request_id] = _Transfer(time.monotonic(), span)
        transfer.assembler.add(chunk.seq, chunk.first_block, chunk.num_blocks, bytes(chunk.data))
        KV_TRANSFER_BYTES.labels(service="decode").inc(len(chunk.data))

    def _on_complete(self, done: KVTransferComplete, ctx: Context) -> None:
        if done.inline:  # the one chunk came inside: as if it had come first, alone
            self._on_chunk(KVBlockChunk(request_id=done.request_id, seq=0,
                                        first_block=done.first_block,
                                        num_blocks=done.num_blocks, data=done.data), ctx)
        transfer = self.transfers.pop(done.request_id, None)
        if transfer is None:
            self._error(done.reply_subject, done.request_id, errors.KV_TRANSFER_FAILED,
                        "no KV chunks arrived", ctx)
            return
        transfer.span.set_attribute("evenflow.kv.bytes", transfer.assembler.num_bytes)
        transfer.span.end()
        try:
            kv = transfer.assembler.finish(done.num_chunks, done.num_blocks, done.dtype,
                                           self.engine.layout.kv_block_shape)
        except kv_handoff.KVHandoffError as exc:
            self._error(done.reply_subject, done.request_id, errors.KV_TRANSFER_FAILED,
                        str(exc), ctx)
            return
        if len(done.hidden):
            kv = replace(kv, hidden=done.hidden, hidden_dtype=done.hidden_dtype)
        self.kv_bytes_received += len(kv.data)
        self.kv_transfer_seconds += max(0.0, time.time() - done.export_started_at)
        self._admit(done.request_id, done.prompt_token_ids, done.sampling, done.reply_subject,
                    ctx, AddPrefilled(done.request_id, done.prompt_token_ids,
                                      done.first_token_id, done.sampling, kv,
                                      done.num_cached_tokens))

    def _admit(self, request_id: str, prompt: list[int], spec: SamplingParams,
               reply_subject: str, ctx: Context, prefilled: AddPrefilled | None) -> None:
        """Admission control, then the engine thread adds it (prefilled: with its K/V)."""
        self.gateway_alive(reply_subject)
        if self.draining:
            self._error(reply_subject, request_id, self.draining_code(),
                        "decode worker is draining", ctx)
            return
        needed = self.engine.layout.blocks_needed(len(prompt) + 1)
        seqs = self.engine.num_running + self.engine.num_waiting + len(self.active)
        cap = 2 * self.config.max_num_seqs
        if self._free_blocks() < needed or (seqs >= cap and not self._outranks(
                spec.priority)):
            self._error(reply_subject, request_id, errors.NO_CAPACITY,
                        "decode worker has no KV room", ctx)
            return
        queue_span = self.tracer.start_span("decode.queue", context=ctx,
                                            attributes={"gen_ai.request.id": request_id})
        span = self.tracer.start_span("decode.generate", context=ctx,
                                      attributes={"gen_ai.request.id": request_id})
        self.active[request_id] = _Active(reply_subject, span, needed, queue_span,
                                          sent=1 if prefilled else 0, priority=spec.priority)
        command: EngineCommand = prefilled or AddRequest(request_id, prompt, spec)
        self.engine_thread.submit(command)

    def _outranks(self, priority: int) -> bool:
        """Past the cap, a request that ranks above one this worker holds still comes in (up
        to a quarter more than max_num_seqs held): the engine preempts the worse one for it
        (engine/core/scheduler.py), where a refusal would send it round the gateway's wait
        (the gateway lets as many past its own limit: gateway/admission.py)."""
        limit = self.config.max_num_seqs + max(1, self.config.max_num_seqs // 4)
        if len(self.active) >= limit:
            return False
        return priority < max((a.priority for a in self.active.values()), default=0)

    def on_admitted(self, event: Admitted) -> None:
        active = self.active.get(event.request_id)
        if active is not None:
            active.blocks = 0  # the engine holds them now
            active.admitted_ns = event.at_ns
            if active.queue_span is not None:
                active.queue_span.end(end_time=event.at_ns)
                active.queue_span = None

    def on_rejected(self, event: Rejected) -> None:
        active = self.active.pop(event.request_id, None)
        if active is not None:
            if active.queue_span is not None:
                active.queue_span.end()
            active.span.end()
            self._error(active.reply_subject, event.request_id, errors.BAD_REQUEST,
                        event.reason, None)

    def on_step_failed(self, event: StepFailed) -> None:
        """Requests lost to a failed step: a retryable error each (the gateway moves them to
        another worker, keeping what was streamed; a poison request fails after its retries)."""
        for request_id in event.request_ids:
            active = self.active.pop(request_id, None)
            if active is not None:
                if active.queue_span is not None:
                    active.queue_span.end()
                active.span.end()
                self._error(active.reply_subject, request_id, errors.ENGINE_FAILED,
                            f"the engine step failed: {event.reason}", None)

    def _error(self, subject: str, request_id: str, code: str, description: str,
               ctx: Context | None) -> None:
        self.send(subject, ErrorMessage(request_id=request_id, code=code,
                                        description=description,
                                        retryable=code in errors.RETRYABLE,
                                        worker_id=self.worker_id), ctx)

    async def _sweep_transfers(self) -> None:
        """Transfers that never complete are dropped (the gateway times the request out)."""
        while True:
            await asyncio.sleep(1.0)
            cutoff = time.monotonic() - self.config.kv_transfer_timeout_s
            for request_id in [r for r, t in self.transfers.items() if t.started < cutoff]:
                self.transfers.pop(request_id).span.end()

    # -- outbound ---------------------------------------------------------------------------
    def on_outputs(self, outputs: StepDone) -> None:
        by_gateway: dict[str, list[TokenDelta]] = defaultdict(list)
        for out in outputs.outputs:
            active = self.active.get(out.request_id)
            if active is None:
                continue
            finish = out.finish_reason.value if out.finished and out.finish_reason else None
            queued_s = computed_s = 0.0
            if active.sent == 0:  # prefilled here: the first token's queue and compute time
                queued_s, computed_s = first_token_times(active.received_ns, active.admitted_ns)
            by_gateway[active.reply_subject].append(TokenDelta(
                request_id=out.request_id, token_ids=out.new_token_ids, finish_reason=finish,
                num_prompt_tokens=out.num_prompt_tokens,
                num_cached_tokens=out.num_cached_tokens, first_index=active.sent,
                queued_s=queued_s, computed_s=computed_s, draft_tokens=out.draft_tokens,
                accepted_draft_tokens=out.accepted_draft_tokens, **logprob_fields(out)))
            active.sent += len(out.new_token_ids)
            if out.finished:
                del self.active[out.request_id]
                active.span.set_attribute("gen_ai.usage.output_tokens", active.sent)
                active.span.end()
        for subject, deltas in by_gateway.items():
            self.send(subject, TokenDeltas(worker_id=self.worker_id, deltas=deltas))
