"""Prefill worker: PrefillRequest in -> prompt computed with the local prefix cache -> first
token straight to the gateway -> the prompt's KV blocks shipped to the chosen decode worker in
numbered chunks, then KVTransferComplete.

Data flow: receive request -> engine thread (batched with other prompts) -> sample first token ->
emit delta -> (next engine step) export KV -> chunk -> send. The first token never waits for the
K/V copy.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from opentelemetry import trace
from opentelemetry.context import Context

from evenflow.engine import create_engine
from evenflow.engine.engine import EngineConfig, StepOutput
from evenflow.engine.sampling_params import SamplingParams
from evenflow.engine.sequence import FinishReason
from evenflow.proto import errors, subjects
from evenflow.proto.messages import (
    Cancel,
    ErrorMessage,
    KVBlockChunk,
    KVTransferComplete,
    Message,
    PrefillRequest,
    TokenDelta,
    TokenDeltas,
    WorkerHeartbeat,
)
from evenflow.services.metrics import KV_TRANSFER_BYTES
from evenflow.services.worker import WorkerService


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


def kv_to_chunks(kv: torch.Tensor, max_bytes: int) -> list[tuple[int, int, memoryview]]:
    """Split block-major K/V (blocks, ...) into (first_block, num_blocks, bytes) chunks of at
    most `max_bytes` (at least one block). The chunks are views: no copy until msgpack packs."""
    raw = memoryview(kv.contiguous().view(torch.uint8).numpy().reshape(-1))
    per_block = len(raw) // kv.shape[0]
    step = max(1, max_bytes // per_block) if per_block else kv.shape[0]  # (mock: no bytes)
    return [(first, min(step, kv.shape[0] - first),
             raw[first * per_block : (first + step) * per_block])
            for first in range(0, kv.shape[0], step)]


class PrefillWorker(WorkerService):
    role = "prefill"

    async def start(self) -> None:
        engine = create_engine(self.config.engine, EngineConfig(**self.config.engine_kwargs()),
                               self.kv_listener)
        self.pending: dict[str, _Pending] = {}
        await self.serve_engine(engine, self._on_outputs)
        await self.bus.subscribe(subjects.prefill_worker(self.worker_id), self._on_message)

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
        return WorkerHeartbeat(
            self.worker_id, "prefill" if not self.draining else "draining",
            self.config.model_name, self.engine.num_running, self.engine.num_waiting,
            self.engine.blocks.num_free_blocks, self.engine.blocks.num_blocks,
            sum(by_gateway.values()), time.time(), self.epoch, load_by_gateway=by_gateway)

    def busy(self) -> bool:
        return bool(self.pending)

    def autoscaling_stats(self) -> dict[str, float]:
        return {"queued_prompt_tokens": float(self._queued_prompt_tokens())}

    # -- inbound ----------------------------------------------------------------------------
    def _on_message(self, message: Message, ctx: Context) -> None:
        if isinstance(message, PrefillRequest):
            self._on_request(message, ctx)
        elif isinstance(message, Cancel):
            if self.pending.pop(message.request_id, None) is not None:
                self.thread.submit(lambda: self.engine.abort(message.request_id))

    def _on_request(self, req: PrefillRequest, ctx: Context) -> None:
        if self.draining:
            self._fail(req, errors.DRAINING, "prefill worker is draining", ctx)
            return
        span = self.tracer.start_span("prefill.queue", context=ctx, attributes={
            "gen_ai.request.id": req.request_id,
            "gen_ai.usage.input_tokens": len(req.prompt_token_ids)})
        pending = self.pending[req.request_id] = _Pending(req, span, ctx)
        first_token_only = SamplingParams(**{**dataclasses.asdict(req.sampling), "max_tokens": 1})

        def admit() -> None:  # on the engine thread
            pending.admitted_ns = time.time_ns()
            try:
                self.engine.add_request(req.request_id, req.prompt_token_ids, first_token_only,
                                        export_kv=True)
            except ValueError as exc:
                self.loop.call_soon_threadsafe(self._rejected, req.request_id, str(exc))

        self.thread.submit(admit)

    def _rejected(self, request_id: str, reason: str) -> None:
        pending = self.pending.pop(request_id, None)
        if pending is not None:
            pending.queue_span.end()
            self._fail(pending.request, errors.BAD_REQUEST, reason, None)

    def _fail(self, req: PrefillRequest, code: str, description: str, ctx) -> None:
        self.send(req.reply_subject, ErrorMessage(req.request_id, code, description,
                                                  code in errors.RETRYABLE), ctx)

    # -- outbound ---------------------------------------------------------------------------
    def _on_outputs(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            if out.kv is not None:  # the K/V of a request whose first token went out
                pending = self.pending.pop(out.request_id, None)
                if pending is not None and pending.awaiting_kv:
                    self._ship_kv(pending, out)
            elif out.finished:
                pending = self.pending.get(out.request_id)
                if pending is not None:
                    self._first_token(pending, out)
                    if not pending.awaiting_kv:
                        self.pending.pop(out.request_id, None)

    def _first_token(self, pending: _Pending, out: StepOutput) -> None:
        req = pending.request
        pending.queue_span.end(end_time=pending.admitted_ns or None)
        compute = self.tracer.start_span(
            "prefill.compute", context=pending.context, start_time=pending.admitted_ns or None,
            attributes={"gen_ai.request.id": req.request_id,
                        "evenflow.cached_tokens": out.num_cached_tokens})
        compute.end()
        if out.finish_reason is FinishReason.ABORT or not out.new_token_ids:
            return
        token = out.new_token_ids[0]
        finish = None
        if out.finish_reason is FinishReason.STOP:
            finish = "stop"
        elif (req.sampling.max_tokens == 1
              or len(req.prompt_token_ids) + 1 >= self.engine.max_model_len):
            finish = "length"
        delta = TokenDelta(req.request_id, [token], finish, len(req.prompt_token_ids),
                           out.num_cached_tokens)
        self.send(req.reply_subject, TokenDeltas(self.worker_id, [delta]),
                  trace.set_span_in_context(compute))
        if finish is None and out.kv_follows:
            pending.awaiting_kv, pending.compute_span = True, compute
            pending.token, pending.num_cached_tokens = token, out.num_cached_tokens

    def _ship_kv(self, pending: _Pending, out: StepOutput) -> None:
        req, token = pending.request, pending.token
        assert out.kv is not None and pending.compute_span is not None
        export_started = time.time()  # the K/V is in hand: transfer bandwidth counts from here
        transfer = self.tracer.start_span("kv_transfer", context=trace.set_span_in_context(
            pending.compute_span))
        chunks = kv_to_chunks(out.kv, self.config.kv_chunk_bytes)
        transfer.set_attribute("evenflow.kv.blocks", out.kv.shape[0])
        transfer.set_attribute("evenflow.kv.bytes", sum(len(c[2]) for c in chunks))
        tctx = trace.set_span_in_context(transfer)
        decode_subject = subjects.decode_worker(req.decode_worker)
        for seq, (first, count, data) in enumerate(chunks):
            self.send(decode_subject, KVBlockChunk(req.request_id, seq, first, count, data),  # type: ignore[arg-type]
                      tctx)
            KV_TRANSFER_BYTES.labels(service="prefill").inc(len(data))
        self.send(decode_subject, KVTransferComplete(
            req.request_id, len(chunks), out.kv.shape[0], str(out.kv.dtype).removeprefix("torch."),
            req.prompt_token_ids, token, req.sampling, req.reply_subject,
            pending.num_cached_tokens, req.enqueued_at, export_started), tctx)
        transfer.end()
