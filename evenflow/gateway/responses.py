"""HTTP responses for a validated Job: one JSON body (all choices gathered) or an SSE stream
(each choice's pieces as they come), with usage, logprobs and the admission slot given back
however the response ends."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi.responses import Response, StreamingResponse
from opentelemetry import trace
from opentelemetry.context import Context
from starlette.types import Receive, Scope, Send

from evenflow.gateway.direct import DirectWriter
from evenflow.gateway.fanout import merged
from evenflow.gateway.flight import RequestFailed
from evenflow.gateway.jobs import Gateway, Job, error_from_failure
from evenflow.gateway.render import (
    LogprobRenderer,
    Piece,
    TokenLogprob,
    choice_body,
    chunk_body,
    completion_body,
    delta_chunk,
    usage_chunk,
)
from evenflow.services import tracing
from evenflow.services.metrics import INFLIGHT, REQUESTS, labelled

log = logging.getLogger("evenflow.requests")


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json",
                    headers=headers)


def _sse(data: Any) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else orjson.dumps(data)) + b"\n\n"


def _runs(gateway: Gateway, choices: list[Job]) -> list[Callable[[], AsyncIterator[Piece]]]:
    return [functools.partial(gateway.run, c) for c in choices]


def _renderer(gateway: Gateway, job: Job) -> LogprobRenderer:
    return gateway.token_id_renderer if job.tokens_as_ids else gateway.logprob_renderer


def _rendered_logprobs(gateway: Gateway, job: Job, piece: Piece,
                       offset: int) -> dict[str, Any] | None:
    if job.logprobs is None:
        return None
    render = _renderer(gateway, job)
    return (render.chat(piece.logprobs) if job.kind == "chat"
            else render.completion(piece.logprobs, offset))


async def complete(gateway: Gateway, job: Job, ctx: Context | None,
                   span: trace.Span) -> Response:
    choices = job.choices()
    texts, finishes = [""] * job.n, [None] * job.n  # type: list[str], list[str | None]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(job.n)]
    token = tracing.attach(ctx)
    INFLIGHT.inc()
    try:
        async for index, piece in merged(_runs(gateway, choices)):
            texts[index] += piece.text
            logprobs[index] += piece.logprobs
            finishes[index] = piece.finish or finishes[index]
    except RequestFailed as exc:
        labelled(REQUESTS, job.kind, "error").inc()
        if log.isEnabledFor(logging.INFO):  # (the line costs ~10 µs to make)
            log.info("%s", job.log_line(f"error {exc.code}", choices))
        raise error_from_failure(exc) from None
    finally:
        INFLIGHT.dec()
        tracing.detach(token)
        span.end()
        if job.slot is not None:
            job.slot.release()
    labelled(REQUESTS, job.kind, "ok").inc()
    job.record(choices, finishes)
    if log.isEnabledFor(logging.INFO):  # (the line costs ~10 µs to make)
        log.info("%s", job.log_line("ok", choices))
    if job.drop_output:  # echo with max_tokens 0: the prompt alone
        texts, logprobs = [""] * job.n, [[] for _ in range(job.n)]
        finishes = ["length"] * job.n
        for c in choices:
            c.usage.completion_tokens = 0
    body = []
    for i in range(job.n):
        if job.echo_text is None:
            rendered = _rendered_logprobs(gateway, job, Piece("", None, logprobs[i]), 0)
            if job.shape is None:
                body.append(choice_body(job.kind, i, texts[i], finishes[i], rendered))
                continue
            split = job.shape.split()  # content, reasoning and tool calls
            split.feed(texts[i], final=True)
            body.append(choice_body(job.kind, i, texts[i], split.finish_reason(finishes[i]),
                                    rendered, split.message()))
            continue
        rendered = None if job.logprobs is None else _renderer(gateway, job).echoed(
            job.prompt_ids[0], choices[i].prompt_logprobs, logprobs[i])
        body.append(choice_body(job.kind, i, job.echo_text + texts[i], finishes[i], rendered))
    return json_response(completion_body(job.kind, job.request_id, job.model, body,
                                         job.total_usage(choices)))


class LastChunk(bytes):
    """A stream's final bytes: its last events and `data: [DONE]`, sent together with the end
    of the body (one socket write instead of three)."""


async def stream(gateway: Gateway, job: Job, ctx: Context | None,
                 span: trace.Span) -> AsyncIterator[bytes]:
    """The SSE events of a job's choices. Each event goes out as it comes, except the final
    choice's last one, which waits (no longer than the loop takes to end) to go out with the
    usage chunk, `[DONE]` and the end of the body in one write."""
    token = tracing.attach(ctx)
    INFLIGHT.inc()
    outcome = "ok"
    choices = job.choices()
    first, offsets = [True] * job.n, [0] * job.n
    finishes: list[str | None] = [None] * job.n
    # content, reasoning and tool calls, split as they come (gateway/agent_output.py)
    splits = [job.shape.split() for _ in range(job.n)] if job.shape is not None else None
    tail: list[bytes] = []  # the events that go out with [DONE]
    try:
        async for index, piece in merged(_runs(gateway, choices)):
            event = None
            if splits is not None:
                split = splits[index]
                delta = split.feed(piece.text, final=piece.finish is not None)
                finish = split.finish_reason(piece.finish) if piece.finish else None
                rendered = _rendered_logprobs(gateway, job, piece, offsets[index])
                offsets[index] += len(piece.text)
                if delta is None and finish is None and rendered is None:
                    continue
                usage = job.total_usage(choices) if job.continuous_usage else None
                event = _sse(delta_chunk(job.request_id, job.model, index, delta or {}, finish,
                                         first[index], rendered, usage, job.created))
                if first[index] and job.timings is not None:
                    job.timings.first_chunk()
                first[index] = False
                piece = Piece("", finish)
            if event is None:
                usage = job.total_usage(choices) if job.continuous_usage else None
                event = _sse(chunk_body(job.kind, job.request_id, job.model, index, piece.text,
                                        piece.finish, first[index],
                                        _rendered_logprobs(gateway, job, piece, offsets[index]),
                                        usage, job.created))
                if first[index] and job.timings is not None:
                    job.timings.first_chunk()
                first[index] = False
                offsets[index] += len(piece.text)
            finishes[index] = piece.finish or finishes[index]
            if None in finishes:
                yield event
            else:  # the last choice's last event
                tail.append(event)
        job.record(choices, finishes)
        if job.include_usage:
            tail.append(_sse(usage_chunk(job.kind, job.request_id, job.model,
                                         job.total_usage(choices), job.created)))
    except RequestFailed as exc:
        outcome = "error"
        tail.append(_sse(error_from_failure(exc).body()))
    except BaseException:
        outcome = "cancelled"  # the client went away: client.generate cancelled downstream
        raise
    finally:
        INFLIGHT.dec()
        labelled(REQUESTS, job.kind, outcome).inc()
        if log.isEnabledFor(logging.INFO):  # (the line costs ~10 µs to make)
            log.info("%s", job.log_line(f"{outcome} (streamed)", choices))
        span.end()
        tracing.detach(token)
    tail.append(b"data: [DONE]\n\n")
    yield LastChunk(b"".join(tail))


class AdmittedStream(StreamingResponse):
    """An SSE response that gives its admission slot back however it ends (finished, failed,
    or the client gone before the first byte, when the body generator never even starts).

    Leaner than Starlette's StreamingResponse, which under uvicorn (ASGI spec 2.3) opens an anyio
    task group per response, with a second task listening for the disconnect and a cancel
    scope around each stream (~4% of the gateway's CPU at 16 streams, measured with py-spy).
    Here one future waits for the disconnect and, when it comes, cancels the response's own
    task, as the task group did: the body generator sees CancelledError at its await, its
    `finally` cancels the request downstream, and the response ends normally."""

    def __init__(self, body: AsyncIterator[bytes], release: Callable[[], None],
                 job: Job | None = None) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._release, self._job = release, job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        state = {"ended": False, "gone": False}

        def on_disconnect(waiter: asyncio.Future[None]) -> None:
            if not waiter.cancelled() and not state["ended"]:
                state["gone"] = True
                task.cancel()

        waiter = asyncio.ensure_future(_disconnected(receive))
        waiter.add_done_callback(on_disconnect)
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            # the socket itself, past the ASGI layers, where the server lets us (direct.py)
            writer = DirectWriter.of(scope) if self._job is not None else None
            if self._job is not None:
                self._job.writer = writer
            ended_body = False
            async for chunk in self.body_iterator:
                ended_body = isinstance(chunk, LastChunk)
                if ended_body:  # no disconnect to act on once the body is complete
                    state["ended"] = True
                elif writer is not None and writer.ready():
                    writer.write(chunk)  # type: ignore[arg-type]  # (stream() yields bytes)
                    continue
                if writer is not None:
                    writer.flush()  # what the direct path wrote goes first
                await send({"type": "http.response.body", "body": chunk,
                            "more_body": not ended_body})
            if not ended_body:
                if writer is not None:
                    writer.flush()
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["gone"]:
                raise
            task.uncancel()  # our own cancel, for the client that left: the response is over
        finally:
            state["ended"] = True
            waiter.cancel()
            self._release()


async def _disconnected(receive: Receive) -> None:
    """Returns when the client is gone (the request body was read before the response)."""
    while (await receive())["type"] != "http.disconnect":
        pass
