"""Prefill worker: PrefillRequest in -> prompt computed with the local prefix cache -> first
token straight to the gateway (one message per gateway per step) -> the prompt's KV blocks
shipped to the chosen decode worker in numbered chunks, then KVTransferComplete (layout and
chunking: proto/kv_handoff.py).

Data flow: receive request -> engine thread (batched with other prompts) -> sample first token ->
emit delta -> (next engine step) export KV -> chunk -> send. The first token never waits for the
K/V copy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context

from evenflow.engine import build_engine
from evenflow.proto import errors, kv_handoff, subjects
from evenflow.proto.messages import (
    Cancel,
    ErrorMessage,
    KVBlockChunk,
    KVTransferComplete,
    Message,
    PrefillRequest,
    ProfileRequest,
    Role,
    TokenDelta,
    TokenDeltas,
    WorkerHeartbeat,
)
from evenflow.services.engine_api import EngineOutput, logprob_fields
from evenflow.services.engine_thread import (
    Abort,
    AddRequest,
    Admitted,
    ImportPrefix,
    PrefixImported,
    Rejected,
    StepDone,
    StepFailed,
    first_token_times,
)
from evenflow.services.engine_worker import EngineWorker
from evenflow.services.kv_pull import KVPuller
from evenflow.services.metrics import KV_PULLED_BLOCKS, KV_TRANSFER_BYTES

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    request: PrefillRequest
    queue_span: trace.Span
    context: Context  # the gateway's span, parent of this worker's spans
    admitted_ns: int = 0  # when the engine thread took it (end of queue, start of compute)
    awaiting_kv: bool = False  # the first token is out; its K/V comes with the next step
    compute_span: trace.Span | None = None
    token: int = 0  # the first token, sent along with the KV
    num_cached_tokens: int = 0
    received_ns: int = field(default_factory=time.time_ns)  # (clock of Admitted.at_ns)


class PrefillWorker(EngineWorker):
    role = Role.PREFILL
    handlers = {"prefill": "_on_message", "kv_pulled": "_on_pulled"}

    async def start(self) -> None:
        engine = build_engine(**self.engine_build_args())
        self.take_role()
        await self.serve_engine(engine)
        await self.subscribe_role_subjects()

    def take_role(self) -> None:
        self.pending: dict[str, _Pending] = {}
        self.puller = KVPuller(self.send, self.worker_id, lambda: self.engine.layout.kv_block_shape,
                               self.config.kv_pull_timeout_s)
        self._pull_tasks: set[asyncio.Task] = set()

    def leave_role(self) -> None:
        for task in self._pull_tasks:
            task.cancel()

    def hand_back(self) -> int:
        handed = list(self.pending)
        for request_id in handed:
            pending = self.pending.pop(request_id)
            self.puller.cancel(request_id)
            pending.queue_span.end()
            self.engine_thread.submit(Abort(request_id))
            self._fail(pending.request, errors.ROLE_SWITCHED,
                       "prefill worker is switching role", None)
        return len(handed)

    def _on_pulled(self, message: Message, ctx: Context) -> None:
        self.puller.on_message(message, ctx)

    def _queued_by_gateway(self) -> dict[str, int]:
        """Prompt tokens not yet computed (requests only waiting for their K/V copy excluded),
        by the gateway (reply subject) that sent them."""
        queued: dict[str, int] = defaultdict(int)
        for p in self.pending.values():
            if not p.awaiting_kv:
                queued[p.request.reply_subject] += len(p.request.prompt_token_ids)
        return dict(queued)

    def _queued_prompt_tokens(self) -> int:
        return sum(self._queued_by_gateway().values())

    def heartbeat(self) -> WorkerHeartbeat:
        by_gateway = self._queued_by_gateway()
        return dataclasses.replace(
            super().heartbeat(), running=self.engine.num_running,
            waiting=self.engine.num_waiting, free_kv_blocks=self.engine.num_free_kv_blocks,
            total_kv_blocks=self.engine.layout.num_kv_blocks,
            queued_prompt_tokens=sum(by_gateway.values()), load_by_gateway=by_gateway)

    def busy(self) -> bool:
        return bool(self.pending)

    def load_stats(self) -> dict[str, float]:
        return {"queued_prompt_tokens": float(self._queued_prompt_tokens())}

    # -- inbound ----------------------------------------------------------------------------
    def _on_message(self, message: Message, ctx: Context) -> None:
        if isinstance(message, PrefillRequest):
            self._on_request(message, ctx)
        elif isinstance(message, Cancel):
            self.puller.cancel(message.request_id)
            if self.pending.pop(message.request_id, None) is not None:
                self.engine_thread.submit(Abort(message.request_id))
        elif isinstance(message, ProfileRequest):
            self.start_profile(message)

    def drop_requests_of(self, reply_subjects: set[str]) -> int:
        orphans = [r for r, p in self.pending.items()
                   if p.request.reply_subject in reply_subjects]
        for request_id in orphans:
            self.puller.cancel(request_id)
            self.pending.pop(request_id).queue_span.end()
            self.engine_thread.submit(Abort(request_id))
        return len(orphans)

    def _on_request(self, req: PrefillRequest, ctx: Context) -> None:
        self.gateway_alive(req.reply_subject)
        if self.draining:
            self._fail(req, self.draining_code(), "prefill worker is draining", ctx)
            return
        if req.sampling.max_tokens < 1:  # (checked before any token is sent)
            self._fail(req, errors.BAD_REQUEST, "max_tokens must be at least 1", ctx)
            return
        if not self.decode_alive(req.decode_worker):
            self._fail(req, errors.NO_CAPACITY, f"decode worker {req.decode_worker!r} is not "
                       f"alive (no heartbeat within {self.config.worker_timeout_s:g} s)", ctx)
            return
        span = self.tracer.start_span("prefill.queue", context=ctx, attributes={
            "gen_ai.request.id": req.request_id,
            "gen_ai.usage.input_tokens": len(req.prompt_token_ids)})
        self.pending[req.request_id] = _Pending(req, span, ctx)
        first_block, last_block = self._pull_plan(req)
        if first_block < last_block:
            task = asyncio.create_task(self._pull_then_add(req, first_block, last_block, span))
            self._pull_tasks.add(task)
            task.add_done_callback(self._pull_tasks.discard)
        else:
            self._add(req)

    def _add(self, req: PrefillRequest) -> None:
        first_token_only = dataclasses.replace(req.sampling, max_tokens=1,
                                               min_tokens=min(req.sampling.min_tokens, 1))
        self.engine_thread.submit(AddRequest(req.request_id, req.prompt_token_ids,
                                             first_token_only, export_kv=True))

    def _pull_plan(self, req: PrefillRequest) -> tuple[int, int]:
        """The prompt's blocks [first, last) to ask req.kv_source for: those past what this
        cache holds, up to the last the prompt can take from a cache (the holder sends what it
        has of them), when the index credits the holder with at least kv_pull_min_tokens of
        them (empty: recompute)."""
        min_tokens = self.config.kv_pull_min_tokens
        if not req.kv_source or req.kv_source == self.worker_id or min_tokens <= 0 \
                or req.sampling.lora_name:  # (pulls name blocks by the base model's hashes)
            return 0, 0
        bs = self.engine.layout.block_size
        last = (len(req.prompt_token_ids) - 1) // bs
        first = self.engine.prefix.cached_prefix_blocks(req.prompt_token_ids)
        credited = min(req.kv_source_blocks, last) - first
        return (first, last) if credited * bs >= min_tokens else (0, 0)

    async def _pull_then_add(self, req: PrefillRequest, first_block: int, last_block: int,
                             queue_span: trace.Span) -> None:
        """Pull the blocks, put them into the prefix cache, then add the request (in that
        order on the engine thread); on any failure of the pull, add it as it is."""
        pull_span = self.tracer.start_span(
            "prefill.kv_pull", context=trace.set_span_in_context(queue_span),
            attributes={"evenflow.kv_pull.source": req.kv_source,
                        "evenflow.kv_pull.first_block": first_block,
                        "evenflow.kv_pull.blocks_wanted": last_block - first_block})
        bs = self.engine.layout.block_size
        try:
            kv = await self.puller.pull(req.request_id, req.kv_source,
                                        req.prompt_token_ids[: last_block * bs], first_block)
            pull_span.set_attribute("evenflow.kv_pull.blocks", kv.num_blocks if kv else 0)
        finally:
            pull_span.end()
        if req.request_id not in self.pending:  # cancelled meanwhile
            return
        if kv is not None:
            self.engine_thread.submit(ImportPrefix(req.request_id, req.prompt_token_ids,
                                                   first_block, kv))
        self._add(req)

    def on_prefix_imported(self, event: PrefixImported) -> None:
        KV_PULLED_BLOCKS.inc(event.num_blocks)
        if event.error:
            log.warning("pulled K/V for %s not imported: %s", event.request_id, event.error)

    def on_admitted(self, event: Admitted) -> None:
        pending = self.pending.get(event.request_id)
        if pending is not None:  # end of its queue time, start of its compute
            pending.admitted_ns = event.at_ns

    def on_rejected(self, event: Rejected) -> None:
        pending = self.pending.pop(event.request_id, None)
        if pending is not None:
            pending.queue_span.end()
            self._fail(pending.request, errors.BAD_REQUEST, event.reason, None)

    def on_step_failed(self, event: StepFailed) -> None:
        for request_id in event.request_ids:
            pending = self.pending.pop(request_id, None)
            if pending is not None:
                pending.queue_span.end()
                self._fail(pending.request, errors.ENGINE_FAILED,
                           f"the engine step failed: {event.reason}", None)

    def _fail(self, req: PrefillRequest, code: str, description: str,
              ctx: Context | None) -> None:
        self.send(req.reply_subject, ErrorMessage(
            request_id=req.request_id, code=code, description=description,
            retryable=code in errors.RETRYABLE, worker_id=self.worker_id), ctx)

    # -- outbound ---------------------------------------------------------------------------
    def on_outputs(self, outputs: StepDone) -> None:
        """First tokens go out as one TokenDeltas message per gateway per step (as the decode
        worker's tokens do), before any K/V that came in the same step."""
        firsts: dict[str, list[TokenDelta]] = defaultdict(list)
        exports: list[EngineOutput] = []
        for out in outputs.outputs:
            if out.kv is not None:  # the K/V of a request whose first token went out
                exports.append(out)
                continue
            pending = self.pending.get(out.request_id)
            if not out.finished or pending is None:
                continue
            delta = self._first_token(pending, out)
            if delta is not None:
                firsts[pending.request.reply_subject].append(delta)
            if not pending.awaiting_kv:
                self.pending.pop(out.request_id, None)
        for subject, deltas in firsts.items():
            self.send(subject, TokenDeltas(worker_id=self.worker_id, deltas=deltas))
        for out in exports:
            pending = self.pending.pop(out.request_id, None)
            if pending is not None and pending.awaiting_kv and out.kv is not None:
                self._ship_kv(pending, out.kv)

    def _first_token(self, pending: _Pending, out: EngineOutput) -> TokenDelta | None:
        """The request's first token (None when it has none: aborted); a request whose K/V
        follows waits for it."""
        req = pending.request
        pending.queue_span.end(end_time=pending.admitted_ns or None)
        compute = self.tracer.start_span(
            "prefill.compute", context=pending.context, start_time=pending.admitted_ns or None,
            attributes={"gen_ai.request.id": req.request_id,
                        "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
                        "evenflow.cached_tokens": out.num_cached_tokens})
        compute.end()
        reason = out.finish_reason.value if out.finish_reason is not None else None
        if reason == "abort" or not out.new_token_ids:
            return None
        token = out.new_token_ids[0]
        finish = None
        if reason == "stop":
            finish = "stop"
        elif (req.sampling.max_tokens == 1
              or len(req.prompt_token_ids) + 1 >= self.engine.layout.max_model_len):
            finish = "length"
        if finish is None and out.kv_follows:
            pending.awaiting_kv, pending.compute_span = True, compute
            pending.token, pending.num_cached_tokens = token, out.num_cached_tokens
        queued_s, computed_s = first_token_times(pending.received_ns, pending.admitted_ns)
        return TokenDelta(request_id=req.request_id, token_ids=[token], finish_reason=finish,
                          num_prompt_tokens=len(req.prompt_token_ids),
                          num_cached_tokens=out.num_cached_tokens, first_index=0,
                          queued_s=queued_s, computed_s=computed_s, **logprob_fields(out))

    def _ship_kv(self, pending: _Pending, kv: kv_handoff.KVPayload) -> None:
        req, token = pending.request, pending.token
        assert pending.compute_span is not None
        export_started = time.time()  # the K/V is in hand: transfer bandwidth counts from here
        transfer = self.tracer.start_span("kv_transfer", context=trace.set_span_in_context(
            pending.compute_span))
        chunks = kv_handoff.split(kv, self.config.kv_chunk_bytes)
        total_bytes = sum(len(c.data) for c in chunks)
        transfer.set_attribute("evenflow.kv.blocks", kv.num_blocks)
        transfer.set_attribute("evenflow.kv.bytes", total_bytes)
        tctx = trace.set_span_in_context(transfer)
        decode_subject = subjects.kv_transfer(req.decode_worker)
        inline = chunks[0] if len(chunks) == 1 and self.config.kv_inline_handoff else None
        for chunk in [] if inline is not None else chunks:
            self.send(decode_subject, KVBlockChunk(
                request_id=req.request_id, seq=chunk.seq, first_block=chunk.first_block,
                num_blocks=chunk.num_blocks, data=chunk.data), tctx)
        self.send(decode_subject, KVTransferComplete(
            request_id=req.request_id, num_chunks=len(chunks), num_blocks=kv.num_blocks,
            dtype=kv.dtype, prompt_token_ids=req.prompt_token_ids, first_token_id=token,
            sampling=req.sampling, reply_subject=req.reply_subject,
            num_cached_tokens=pending.num_cached_tokens, enqueued_at=req.enqueued_at,
            export_started_at=export_started, inline=inline is not None,
            data=inline.data if inline else b"",
            first_block=inline.first_block if inline else 0, hidden=kv.hidden,
            hidden_dtype=kv.hidden_dtype), tctx)
        KV_TRANSFER_BYTES.labels(service="prefill").inc(total_bytes)
        transfer.end()
