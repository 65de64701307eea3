"""Limits at the gateway's HTTP edge, applied before any work is done: the ASGI middleware
that checks header size, the API key and the body size, and the admission queue that bounds
how many requests run and wait at once."""

from __future__ import annotations

import asyncio
import hmac

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from evenflow.gateway.protocol import APIError
from evenflow.services.config import MeshConfig


class Admission:
    """At most `max_inflight` requests run at once; up to `max_queued` more wait for a slot;
    beyond that a request is refused at once with 429 and Retry-After, before any stream
    starts, so memory stays bounded under a burst."""

    def __init__(self, max_inflight: int, max_queued: int) -> None:
        self.max_queued = max_queued
        self._slots = asyncio.Semaphore(max_inflight)
        self.queued = 0
        self.running = 0

    async def acquire(self) -> None:
        if self._slots.locked():
            if self.queued >= self.max_queued:
                raise APIError(429, "Too many requests are queued at this gateway; retry later.",
                               "rate_limit_error", code="overloaded",
                               headers={"Retry-After": "1"})
            self.queued += 1
            try:
                await self._slots.acquire()
            finally:
                self.queued -= 1
        else:
            await self._slots.acquire()
        self.running += 1

    def release(self) -> None:
        self.running -= 1
        self._slots.release()


OPEN_PATHS = ("/health", "/live", "/version")  # answered without a key (probes)
DOCS_PATHS = ("/metrics", "/docs", "/redoc", "/openapi.json")  # keyed unless public_metrics


class EdgeMiddleware:
    """The gateway's limits, applied before any handler or body parsing (ASGI, so streaming
    responses are covered too): header section size (431), the API key (401, compared in
    constant time, checked before the body is read), and the body size (413, counted as it
    arrives, so a lying or absent Content-Length cannot get past it)."""

    def __init__(self, app: ASGIApp, config: MeshConfig, api_keys: tuple[str, ...]) -> None:
        self.app, self.config = app, config
        self.api_keys = tuple(k.encode() for k in api_keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if sum(len(k) + len(v) for k, v in headers) > self.config.max_header_bytes:
            await _reject(send, 431, "Request header fields too large.", "header_too_large")
            return
        if self.api_keys and self._needs_key(scope["path"]) and not self._authorized(headers):
            await _reject(send, 401, "Incorrect API key provided.", "invalid_api_key",
                          "authentication_error")
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await self._read_body(headers, receive)
            if body is None:
                await _reject(send, 413, f"The request body exceeds "
                              f"{self.config.max_body_bytes} bytes.", "body_too_large")
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    def _needs_key(self, path: str) -> bool:
        if path in OPEN_PATHS:
            return False
        return not (self.config.public_metrics and path in DOCS_PATHS)

    def _authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        value = next((v for k, v in headers if k == b"authorization"), b"")
        token = value[7:] if value[:7].lower() == b"bearer " else b""
        found = False
        for key in self.api_keys:  # every key compared, each in constant time
            found |= hmac.compare_digest(token, key)
        return found

    async def _read_body(self, headers: list[tuple[bytes, bytes]],
                         receive: Receive) -> bytes | None:
        """The whole body, or None once it passes the limit (what came is dropped)."""
        limit = self.config.max_body_bytes
        declared = next((v for k, v in headers if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)  # the client left; the app sees an empty body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that hands the app the body already read, then the server's own messages
    (a client that goes away still arrives as http.disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _reject(send: Send, status: int, message: str, code: str,
                  type_: str = "invalid_request_error") -> None:
    body = orjson.dumps(APIError(status, message, type_, code=code).body())
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def read_api_keys(config: MeshConfig) -> tuple[str, ...]:
    """EVENFLOW_API_KEYS plus the lines of EVENFLOW_API_KEY_FILE (never argv)."""
    keys = list(config.api_keys)
    if config.api_key_file:
        with open(config.api_key_file) as f:
            keys += [line.strip() for line in f if line.strip()]
    return tuple(keys)
