"""KV pulls between workers: a prefill worker that lacks a prompt's leading blocks which another
worker holds (the decode worker holding a chat's history, a peer holding a shared prefix) asks
that worker for them over NATS instead of recomputing them: the prefill -> decode hand-off in
reverse, in the same chunks (proto/kv_handoff.py).

`PullServer` is every worker's holder side: a KVPullRequest becomes an export on its engine
thread (between steps), sent back as KVBlockChunks and a KVPullDone. `KVPuller` is the prefill
worker's asking side: it gathers one pull's chunks within `timeout_s` and hands back the K/V,
or None on a timeout, a refusal or broken chunks. The caller then recomputes: a request never
fails because of a pull.

Every worker may publish to a puller's reply subject, so a reply proves where it comes from
by the pull's nonce: 128 random bits sent only to the asked holder, on the holder's own
subject (which only it may read). A chunk or a completion without it is dropped and counted
(`evenflow_kv_pull_replies_dropped_total`), so no other worker's credentials can put a single
block into the asker's prefix cache.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from opentelemetry.context import Context

from evenflow.proto import kv_handoff, subjects
from evenflow.proto.messages import KVBlockChunk, KVPullDone, KVPullRequest, Message
from evenflow.services.engine_thread import EngineCommand, ExportPrefix, PrefixExported
from evenflow.services.metrics import (
    KV_PULL_REPLIES_DROPPED,
    KV_PULL_SECONDS,
    KV_PULLS,
    KV_PULLS_SERVED,
)

log = logging.getLogger(__name__)

Send = Callable[[str, Message, Context | None], None]


class PullServer:
    """The holder's side: pull requests in, this engine's cached blocks out."""

    def __init__(self, send: Send, submit: Callable[[EngineCommand], None],
                 worker_id: str, chunk_bytes: int) -> None:
        self._send, self._submit = send, submit
        self.worker_id, self.chunk_bytes = worker_id, chunk_bytes

    def on_request(self, message: Message, ctx: Context) -> None:
        if not isinstance(message, KVPullRequest):
            return
        if not subjects.matches(subjects.kv_pulled("*"), message.reply_subject):
            log.warning("ignored a KV pull answering to %r", message.reply_subject)
            return
        self._submit(ExportPrefix(message.request_id, message.prompt_token_ids,
                                  message.first_block, message.reply_subject, message.nonce))

    def on_exported(self, event: PrefixExported) -> None:
        """The export is done (engine thread): send its chunks and the completion."""
        kv = event.kv
        if kv is None:
            self._send(event.reply_subject, KVPullDone(
                request_id=event.request_id, num_chunks=0, num_blocks=0,
                first_block=event.first_block, dtype="", worker_id=self.worker_id,
                error=event.error or "export failed", nonce=event.nonce), None)
            return
        chunks = kv_handoff.split(kv, self.chunk_bytes) if kv.num_blocks else []
        for chunk in chunks:
            self._send(event.reply_subject, KVBlockChunk(
                request_id=event.request_id, seq=chunk.seq, first_block=chunk.first_block,
                num_blocks=chunk.num_blocks, data=chunk.data, nonce=event.nonce), None)
        self._send(event.reply_subject, KVPullDone(
            request_id=event.request_id, num_chunks=len(chunks), num_blocks=kv.num_blocks,
            first_block=event.first_block, dtype=kv.dtype, worker_id=self.worker_id,
            nonce=event.nonce), None)
        KV_PULLS_SERVED.labels(what="pulls").inc()
        KV_PULLS_SERVED.labels(what="blocks").inc(kv.num_blocks)


@dataclass
class _Pull:
    holder: str
    done: asyncio.Future[kv_handoff.KVPayload | None]
    nonce: str
    assembler: kv_handoff.Assembler = field(default_factory=kv_handoff.Assembler)


class KVPuller:
    """The asking side (a prefill worker): one pull per request at a time."""

    def __init__(self, send: Send, worker_id: str, block_shape: Callable[[], tuple[int, ...]],
                 timeout_s: float) -> None:
        self._send, self.worker_id = send, worker_id
        self._block_shape, self.timeout_s = block_shape, timeout_s
        self._pulls: dict[str, _Pull] = {}

    @property
    def reply_subject(self) -> str:
        return subjects.kv_pulled(self.worker_id)

    async def pull(self, request_id: str, holder: str, prompt: list[int],
                   first_block: int) -> kv_handoff.KVPayload | None:
        """Blocks first_block, first_block + 1, ... of the prompt from `holder`, as far as it
        holds them; None when there are none or the pull failed (the caller recomputes)."""
        started = time.perf_counter()
        nonce = secrets.token_hex(16)
        pull = self._pulls[request_id] = _Pull(
            holder, asyncio.get_running_loop().create_future(), nonce)
        self._send(subjects.kv_pull(holder), KVPullRequest(
            request_id=request_id, prompt_token_ids=prompt, first_block=first_block,
            reply_subject=self.reply_subject, nonce=nonce), None)
        try:
            kv = await asyncio.wait_for(pull.done, self.timeout_s)
        except TimeoutError:
            KV_PULLS.labels(outcome="timeout").inc()
            log.info("KV pull of %s from %s timed out after %.2f s; recomputing", request_id,
                     holder, self.timeout_s)
            return None
        finally:
            self._pulls.pop(request_id, None)
        if kv is not None:
            KV_PULL_SECONDS.observe(time.perf_counter() - started)
        return kv

    def cancel(self, request_id: str) -> None:
        """The request is gone: stop waiting for its pull."""
        pull = self._pulls.pop(request_id, None)
        if pull is not None and not pull.done.done():
            pull.done.set_result(None)

    def _pull_of(self, message: KVBlockChunk | KVPullDone) -> _Pull | None:
        """The pull a reply answers, if it carries that pull's nonce; else it is dropped."""
        pull = self._pulls.get(message.request_id)
        if pull is None:
            KV_PULL_REPLIES_DROPPED.labels(reason="no_pull").inc()  # late, or forged
            return None
        if not hmac.compare_digest(message.nonce, pull.nonce):
            KV_PULL_REPLIES_DROPPED.labels(reason="bad_nonce").inc()
            log.warning("dropped a KV pull reply for %s without its pull's nonce (forged, "
                        "or not from %s)", message.request_id, pull.holder)
            return None
        return pull

    def on_message(self, message: Message, ctx: Context) -> None:
        if isinstance(message, KVBlockChunk):
            pull = self._pull_of(message)
            if pull is not None:
                pull.assembler.add(message.seq, message.first_block, message.num_blocks,
                                   bytes(message.data))
        elif isinstance(message, KVPullDone):
            self._on_done(message)

    def _on_done(self, done: KVPullDone) -> None:
        pull = self._pull_of(done)
        if pull is None or pull.done.done():
            return
        if done.error or not done.num_blocks:
            KV_PULLS.labels(outcome="refused" if done.error else "empty").inc()
            if done.error:
                log.info("KV pull of %s refused by %s: %s", done.request_id, pull.holder,
                         done.error)
            pull.done.set_result(None)
            return
        try:
            kv = pull.assembler.finish(done.num_chunks, done.num_blocks, done.dtype,
                                       self._block_shape())
        except kv_handoff.KVHandoffError as exc:
            KV_PULLS.labels(outcome="broken").inc()
            log.info("KV pull of %s from %s broken: %s", done.request_id, pull.holder, exc)
            pull.done.set_result(None)
            return
        KV_PULLS.labels(outcome="pulled").inc()
        pull.done.set_result(kv)
