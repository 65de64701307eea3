"""Decode worker: KV blocks in -> admitted into the paged cache -> continuous batching -> token
ids back to each gateway, one TokenDeltas message per gateway per engine step.

Also serves DecodeRequest (short prompts prefilled here: conditional disaggregation). A chunk that
arrives out of order or twice fails its request; a request that does not fit is rejected with a
retryable NO_CAPACITY error, and the gateway tries another worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
from opentelemetry import trace
from opentelemetry.context import Context

from evenflow.engine import create_engine
from evenflow.engine.engine import EngineConfig, StepOutput
from evenflow.engine.sampling_params import SamplingParams
from evenflow.proto import errors, subjects
from evenflow.proto.messages import (
    Cancel,
    DecodeRequest,
    ErrorMessage,
    KVBlockChunk,
    KVTransferComplete,
    Message,
    SamplingSpec,
    TokenDelta,
    TokenDeltas,
    WorkerHeartbeat,
)
from evenflow.services.metrics import KV_TRANSFER_BYTES
from evenflow.services.worker import WorkerService


@dataclass
class _Transfer:
    """Chunks of one request's KV, in arrival order."""

    started: float
    span: trace.Span
    chunks: list[bytes] = field(default_factory=list)
    broken: str | None = None  # why the transfer failed, once it has


@dataclass
class _Active:
    reply_subject: str
    span: trace.Span  # decode.generate
    blocks: int  # KV blocks promised until the engine admits it
    queue_span: trace.Span | None = None


class DecodeWorker(WorkerService):
    role = "decode"

    async def start(self) -> None:
        engine = create_engine(self.config.engine, EngineConfig(**self.config.engine_kwargs()),
                               self.kv_listener)
        self.transfers: dict[str, _Transfer] = {}
        self.kv_bytes_received = 0
        self.kv_transfer_seconds = 0.0
        self.active: dict[str, _Active] = {}
        await self.serve_engine(engine, self._on_outputs)
        self._sweeper = asyncio.create_task(self._sweep_transfers(), name="sweep transfers")
        await self.bus.subscribe(subjects.decode_worker(self.worker_id), self._on_message)

    def heartbeat(self) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            self.worker_id, "decode" if not self.draining else "draining", self.config.model_name,
            self.engine.num_running, self.engine.num_waiting, self._free_blocks(),
            self.engine.blocks.num_blocks, 0, time.time(), self.epoch, self.kv_bytes_received,
            self.kv_transfer_seconds,
            dict(Counter(a.reply_subject for a in self.active.values())))

    def busy(self) -> bool:
        return bool(self.active or self.transfers)

    def autoscaling_stats(self) -> dict[str, float]:
        return {"running_sequences": float(self.engine.num_running + self.engine.num_waiting),
                "free_kv_fraction": self._free_blocks() / max(1, self.engine.blocks.num_blocks)}

    async def shutdown(self) -> None:
        self._sweeper.cancel()

    def _free_blocks(self) -> int:
        """Free blocks less those promised to requests not yet admitted by the engine."""
        return self.engine.blocks.num_free_blocks - sum(
            a.blocks for a in self.active.values() if a.blocks)

    # -- inbound ----------------------------------------------------------------------------
    def _on_message(self, message: Message, ctx: Context) -> None:
        if isinstance(message, KVBlockChunk):
            self._on_chunk(message, ctx)
        elif isinstance(message, KVTransferComplete):
            self._on_complete(message, ctx)
        elif isinstance(message, DecodeRequest):
            self._admit(message.request_id, message.prompt_token_ids, None, message.sampling,
                        message.reply_subject, 0, ctx)
        elif isinstance(message, Cancel):
            self.transfers.pop(message.request_id, None)
            if message.request_id in self.active:
                self.thread.submit(lambda: self.engine.abort(message.request_id))

    def _on_chunk(self, chunk: KVBlockChunk, ctx: Context) -> None:
        transfer = self.transfers.get(chunk.request_id)
        if transfer is None:
            span = self.tracer.start_span("decode.kv_receive", context=ctx)
            transfer = self.transfers[chunk.request_id] = _Transfer(time.monotonic(), span)
        if transfer.broken:
            return
        if chunk.seq != len(transfer.chunks):
            kind = "duplicated" if chunk.seq < len(transfer.chunks) else "missing"
            transfer.broken = (f"KV chunk {chunk.seq} arrived when {len(transfer.chunks)} was "
                               f"expected ({kind} chunk)")
            transfer.chunks.clear()
            return
        transfer.chunks.append(chunk.data)
        KV_TRANSFER_BYTES.labels(service="decode").inc(len(chunk.data))

    def _on_complete(self, done: KVTransferComplete, ctx: Context) -> None:
        transfer = self.transfers.pop(done.request_id, None)
        broken = transfer.broken if transfer else "no KV chunks arrived"
        if transfer is not None:
            transfer.span.set_attribute("evenflow.kv.bytes", sum(map(len, transfer.chunks)))
            transfer.span.end()
        if broken is None and transfer is not None and len(transfer.chunks) != done.num_chunks:
            broken = f"{len(transfer.chunks)} of {done.num_chunks} KV chunks arrived"
        if broken is not None or transfer is None:
            self._error(done.reply_subject, done.request_id, errors.KV_TRANSFER_FAILED,
                        broken or "", ctx)
            return
        try:
            dtype = getattr(torch, done.dtype)
            shape = self.engine.runner.kv_shape(done.num_blocks)
            raw = torch.empty(sum(map(len, transfer.chunks)), dtype=torch.uint8)
            dest = raw.numpy()
            offset = 0
            for data in transfer.chunks:  # one copy, straight into the tensor
                dest[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
                offset += len(data)
            kv = raw.view(dtype).view(shape)
            self.kv_bytes_received += offset
            self.kv_transfer_seconds += max(0.0, time.time() - done.export_started_at)
        except (AttributeError, RuntimeError, TypeError) as exc:
            self._error(done.reply_subject, done.request_id, errors.KV_TRANSFER_FAILED,
                        f"KV payload does not fit this worker: {exc}", ctx)
            return
        self._admit(done.request_id, done.prompt_token_ids, (done.first_token_id, kv),
                    done.sampling, done.reply_subject, done.num_cached_tokens, ctx)

    def _admit(self, request_id: str, prompt: list[int], prefilled, spec: SamplingSpec,
               reply_subject: str, num_cached: int, ctx: Context) -> None:
        if self.draining:
            self._error(reply_subject, request_id, errors.DRAINING, "decode worker is draining",
                        ctx)
            return
        seqs = self.engine.num_running + self.engine.num_waiting + len(self.active)
        if self._free_blocks() < self.engine.blocks.blocks_needed(len(prompt) + 1) or (
                seqs >= 2 * self.config.max_num_seqs):
            self._error(reply_subject, request_id, errors.NO_CAPACITY,
                        "decode worker has no KV room", ctx)
            return
        queue_span = self.tracer.start_span("decode.queue", context=ctx,
                                            attributes={"gen_ai.request.id": request_id})
        span = self.tracer.start_span("decode.generate", context=ctx,
                                      attributes={"gen_ai.request.id": request_id})
        self.active[request_id] = _Active(reply_subject, span,
                                          self.engine.blocks.blocks_needed(len(prompt) + 1),
                                          queue_span)
        params = SamplingParams(**dataclasses.asdict(spec))

        def add() -> None:  # on the engine thread
            try:
                if prefilled is None:
                    self.engine.add_request(request_id, prompt, params)
                else:
                    self.engine.add_prefilled_request(request_id, prompt, prefilled[0], params,
                                                      prefilled[1], num_cached)
            except ValueError as exc:
                self.loop.call_soon_threadsafe(self._rejected, request_id, str(exc))
            else:
                self.loop.call_soon_threadsafe(self._admitted, request_id)

        self.thread.submit(add)

    def _admitted(self, request_id: str) -> None:
        active = self.active.get(request_id)
        if active is not None:
            active.blocks = 0  # the engine holds them now
            if active.queue_span is not None:
                active.queue_span.end()

    def _rejected(self, request_id: str, reason: str) -> None:
        active = self.active.pop(request_id, None)
        if active is not None:
            if active.queue_span is not None:
                active.queue_span.end()
            active.span.end()
            self._error(active.reply_subject, request_id, errors.BAD_REQUEST, reason, None)

    def _error(self, subject: str, request_id: str, code: str, description: str, ctx) -> None:
        self.send(subject, ErrorMessage(request_id, code, description, code in errors.RETRYABLE),
                  ctx)

    async def _sweep_transfers(self) -> None:
        """Transfers that never complete are dropped (the gateway times the request out)."""
        while True:
            await asyncio.sleep(1.0)
            cutoff = time.monotonic() - self.config.kv_transfer_timeout_s
            for request_id in [r for r, t in self.transfers.items() if t.started < cutoff]:
                self.transfers.pop(request_id).span.end()

    # -- outbound ---------------------------------------------------------------------------
    def _on_outputs(self, outputs: list[StepOutput]) -> None:
        by_gateway: dict[str, list[TokenDelta]] = defaultdict(list)
        for out in outputs:
            active = self.active.get(out.request_id)
            if active is None:
                continue
            finish = out.finish_reason.value if out.finished and out.finish_reason else None
            by_gateway[active.reply_subject].append(TokenDelta(
                out.request_id, out.new_token_ids, finish, out.num_prompt_tokens,
                out.num_cached_tokens))
            if out.finished:
                del self.active[out.request_id]
                active.span.end()
        for subject, deltas in by_gateway.items():
            self.send(subject, TokenDeltas(self.worker_id, deltas))
