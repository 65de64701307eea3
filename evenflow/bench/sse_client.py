"""A lean HTTP/1.1 client for the load generator's streamed completions.

On a 2-core machine the load generator shares the CPU with the mesh it measures, so what it
spends per streamed chunk is taken from the mesh: httpx (h11's state machine, its decoders
and line splitter) spent ~70 us of Python per SSE chunk, as much as the gateway spends
producing it. This client keeps connections alive in a small pool, writes one POST, and
reads a chunked (or sized) body straight off asyncio's stream reader, splitting SSE events
itself: one `data:` payload per event, no per-byte Python work.

It speaks what OpenAI-compatible servers answer (uvicorn, hypercorn, axum): HTTP/1.1,
`Transfer-Encoding: chunked` or `Content-Length`, `Connection: close` honoured; http and https.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import orjson


class HTTPStatusError(RuntimeError):
    """A response other than 200; the message holds the status and the start of its body."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


class SSEClient:
    """POSTs JSON to one server and streams the SSE events back (`async with` to close)."""

    def __init__(self, base_url: str, timeout_s: float = 300.0, max_idle: int = 64) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        self.timeout_s, self.max_idle = timeout_s, max_idle
        self._idle: list[_Connection] = []
        self._host_header = f"{self.host}:{self.port}".encode()

    async def __aenter__(self) -> SSEClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    async def _connect(self) -> tuple[_Connection, bool]:
        """(a connection, whether it is a kept-alive one)"""
        if self._idle:
            return self._idle.pop(), True
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port, ssl=self.ssl, limit=1 << 20),
            self.timeout_s)
        return _Connection(reader, writer), False

    @asynccontextmanager
    async def stream(self, path: str, body: dict, headers: dict[str, str] | None = None
                     ) -> AsyncIterator[AsyncIterator[bytes]]:
        """`async with client.stream(path, body) as events:` then `async for data in events`
        yields each SSE event's `data:` payload (bytes, `[DONE]` included). A non-200 answer
        raises HTTPStatusError; a connection dropped mid-body raises ConnectionError."""
        payload = orjson.dumps(body)
        head = [b"POST ", (self.prefix + path).encode(), b" HTTP/1.1\r\nHost: ",
                self._host_header, b"\r\nContent-Type: application/json\r\n"
                b"Accept: text/event-stream\r\nContent-Length: ", str(len(payload)).encode(),
                b"\r\n"]
        for name, value in (headers or {}).items():
            head += [name.encode(), b": ", value.encode(), b"\r\n"]
        head += [b"\r\n", payload]
        while True:  # a kept-alive connection the server has closed: the next one
            conn, reused = await self._connect()
            try:
                conn.writer.write(b"".join(head))
                async with asyncio.timeout(self.timeout_s):
                    status, chunked, length, keep = await _read_head(conn.reader)
            except (ConnectionError, asyncio.IncompleteReadError, OSError):
                conn.close()
                if not reused:
                    raise
                continue
            break
        reusable = False
        try:
            if status != 200:
                raise HTTPStatusError(status, await _read_body(conn.reader, chunked, length))
            events = _EventIterator(conn.reader, chunked, length, self.timeout_s)
            yield events
            reusable = keep and events.finished
        finally:
            if reusable and len(self._idle) < self.max_idle:
                self._idle.append(conn)
            else:
                conn.close()


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, bool, int, bool]:
    """(status, chunked, content length or -1, keep-alive) of the response's head."""
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    chunked, length, keep = False, -1, True
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == "transfer-encoding":
            chunked = "chunked" in value
        elif name == "content-length":
            length = int(value)
        elif name == "connection":
            keep = value != "close"
    return status, chunked, length, keep and (chunked or length >= 0)


async def _read_body(reader: asyncio.StreamReader, chunked: bool, length: int) -> bytes:
    if not chunked:
        return await reader.readexactly(length) if length >= 0 else await reader.read()
    parts = []
    while (piece := await _next_chunk(reader)) is not None:
        parts.append(piece)
    return b"".join(parts)


async def _next_chunk(reader: asyncio.StreamReader) -> bytes | None:
    """One chunk of a chunked body; None after the last (zero-size) one and its trailer."""
    size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
    if size == 0:
        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the blank line
            pass
        return None
    data = await reader.readexactly(size + 2)
    return data[:-2]


class _EventIterator:
    """SSE `data:` payloads off a response body; `finished` once the body was read whole."""

    def __init__(self, reader: asyncio.StreamReader, chunked: bool, length: int,
                 timeout_s: float) -> None:
        self.reader, self.chunked, self.remaining = reader, chunked, length
        self.timeout_s = timeout_s
        self.buffer = b""
        self.pending: list[bytes] = []
        self.finished = False

    def __aiter__(self) -> _EventIterator:
        return self

    async def __anext__(self) -> bytes:
        while not self.pending:
            if self.finished:
                raise StopAsyncIteration
            async with asyncio.timeout(self.timeout_s):  # (wait_for would start a task)
                data = await self._read()
            if data is None:
                self.finished = True
                data = b"\n\n" if self.buffer else b""
            self.buffer += data
            if b"\r" in self.buffer:  # CRLF line ends (a lone CR waits for its LF)
                self.buffer = self.buffer.replace(b"\r\n", b"\n")
            *events, self.buffer = self.buffer.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        self.pending.append(line[5:].lstrip(b" "))
            self.pending.reverse()
        return self.pending.pop()

    async def whole(self) -> bytes:
        """The body as it is (a non-streamed answer), read to its end."""
        async with asyncio.timeout(self.timeout_s):
            body = await _read_body(self.reader, self.chunked, self.remaining)
        self.finished = True
        return body

    async def _read(self) -> bytes | None:
        if self.chunked:
            return await _next_chunk(self.reader)
        if self.remaining == 0:
            return None
        if self.remaining < 0:  # until the server closes
            data = await self.reader.read(1 << 16)
            return data or None
        data = await self.reader.read(min(self.remaining, 1 << 16))
        if not data:
            raise ConnectionError("the server closed the connection mid-body")
        self.remaining -= len(data)
        return data
