"""The direct path of a streamed response: SSE events written straight to the client's socket,
past the ASGI layers, by whoever has them ready.

- `ExposeConnection` (the outermost ASGI app under uvicorn) puts the connection a request came
  on into its scope; `DirectWriter.of(scope)` writes HTTP chunks to it, as uvicorn would,
  while the socket takes them (a paused transport, a closing one or a finished response: no).
- `DirectStream` is what the NATS inbox calls (through Attempts.offer) for an in-order token
  delta in the middle of a plain stream (one choice, no logprobs, tools or continuous usage)
  while the request's task sleeps: the delta's text, counted and rendered from a byte template,
  goes out in one write, with no task woken and no generator resumed. Anything else (the first
  token, the last, a stop string, a delta out of order, an error) goes to the request's task as
  before, which therefore always sees a stream's state as the direct path left it.

Off with EVENFLOW_DIRECT_STREAM=0 (every event through the task and ASGI's send, for A/B);
under another server (Ray Serve's proxy) there is no connection to write to and the path is
off by itself. The bytes are the same either way (tests/unit/test_direct_stream.py)."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from evenflow.gateway.choice import ChoiceOutput
from evenflow.gateway.render import ChunkTemplate
from evenflow.proto.messages import TokenDelta

CONNECTION_KEY = "evenflow.connection"
_UVICORN_CYCLE = "uvicorn.protocols.http.httptools_impl"


class ExposeConnection:
    """ASGI wrapper: the uvicorn request cycle (its transport and flow control) in the scope."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            cycle = getattr(send, "__self__", None)
            if type(cycle).__module__ == _UVICORN_CYCLE:
                scope[CONNECTION_KEY] = cycle
        await self.app(scope, receive, send)


class _Flusher:
    """Writes the streams' pending chunks once the loop has run what it had ready: a stream
    that gets several deltas in one go (one NATS read holding several steps, a gateway that
    fell behind) costs one socket write, not one each (a loopback write is ~10 µs of this
    process's CPU: the kernel runs the receiving side's TCP in the writer's time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.dirty: list[DirectWriter] = []

    def add(self, writer: DirectWriter) -> None:
        if not self.dirty:
            self.loop.call_soon(self.run)
        self.dirty.append(writer)

    def run(self) -> None:
        dirty, self.dirty = self.dirty, []
        for writer in dirty:
            writer.flush()


_FLUSHERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Flusher] = \
    weakref.WeakKeyDictionary()


class DirectWriter:
    """HTTP chunks of a started, chunked response, written to its socket directly: at the end
    of the loop's current round (`_Flusher`), or at once by `flush` (before anything else
    writes to the socket)."""

    def __init__(self, cycle: Any) -> None:
        self._cycle, self._transport, self._flow = cycle, cycle.transport, cycle.flow
        self._pending: list[bytes] = []
        loop = asyncio.get_running_loop()
        self._flusher = _FLUSHERS.get(loop) or _FLUSHERS.setdefault(loop, _Flusher(loop))

    @classmethod
    def of(cls, scope: Scope) -> DirectWriter | None:
        """The writer of a response whose head was sent, or None (another server, a response
        not chunked)."""
        cycle = scope.get(CONNECTION_KEY)
        if cycle is None or not getattr(cycle, "chunked_encoding", False):
            return None
        return cls(cycle)

    def ready(self) -> bool:
        """The socket takes bytes now (else ASGI's send waits for it, in order)."""
        return not (self._flow.write_paused or self._cycle.response_complete
                    or self._transport.is_closing())

    def write(self, body: bytes) -> None:
        if not self._pending:
            self._flusher.add(self)
        self._pending.append(b"%x\r\n%b\r\n" % (len(body), body))

    def flush(self) -> None:
        pending = self._pending
        if pending:
            self._pending = []
            if not self._transport.is_closing():
                self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))


class DirectStream:
    """A plain stream's middle deltas, from the inbox straight to the socket."""

    def __init__(self, output: ChoiceOutput, writer: DirectWriter,
                 template: ChunkTemplate) -> None:
        self.output, self.writer, self.template = output, writer, template

    def __call__(self, delta: TokenDelta, now: float) -> bool:
        """True: the delta is streamed; False: nothing changed, the task takes it."""
        if delta.logprobs or not self.writer.ready():
            return False
        text = self.output.plain_text(delta, now)
        if text is None:
            return False
        if text:
            self.writer.write(self.template.event(text))
        return True


def plain(job: Any) -> bool:
    """A job whose middle events the direct path may write: one choice, text only."""
    return (job.n == 1 and job.shape is None and job.logprobs is None
            and not job.continuous_usage)
