"""Limits at the gateway's HTTP edge, applied before any work is done: the ASGI middleware
that checks header size, the API key and the body size, and says which tenant a request is
(scope["evenflow.tenant"], for admission: gateway/admission.py)."""

from __future__ import annotations

import hashlib
import hmac

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from evenflow.gateway.admission import DEFAULT_TENANT
from evenflow.gateway.protocol import APIError
from evenflow.services.config import MeshConfig

TENANT_KEY = "evenflow.tenant"


OPEN_PATHS = ("/health", "/live", "/version")  # answered without a key (probes)
DOCS_PATHS = ("/metrics", "/docs", "/redoc", "/openapi.json")  # keyed unless public_metrics


class EdgeMiddleware:
    """The gateway's limits, applied before any handler or body parsing (ASGI, so streaming
    responses are covered too): header section size (431), the API key (401, compared in
    constant time, checked before the body is read), and the body size (413, counted as it
    arrives, so a lying or absent Content-Length cannot get past it)."""

    def __init__(self, app: ASGIApp, config: MeshConfig,
                 api_keys: tuple[str, ...] | dict[str, str]) -> None:
        self.app, self.config = app, config
        named = api_keys if isinstance(api_keys, dict) else dict.fromkeys(api_keys, "")
        # each key with its tenant (a key without one is a tenant of its own, named by a
        # digest of the key: never the key itself, which would land in metrics and logs)
        self.api_keys = tuple(k.encode() for k in named)
        self.tenants = tuple(tenant or "key-" + hashlib.sha256(k.encode()).hexdigest()[:8]
                             for k, tenant in named.items())
        self.tenant_header = config.tenant_header.lower().encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        if sum(len(k) + len(v) for k, v in headers) > self.config.max_header_bytes:
            await _reject(send, 431, "Request header fields too large.", "header_too_large")
            return
        tenant = DEFAULT_TENANT
        if self.api_keys and self._needs_key(scope["path"]):
            key_tenant = self._authorized(headers)
            if key_tenant is None:
                await _reject(send, 401, "Incorrect API key provided.", "invalid_api_key",
                              "authentication_error")
                return
            tenant = key_tenant
        if self.tenant_header:
            named = next((v for k, v in headers if k == self.tenant_header), b"")
            if named:
                tenant = named.decode("latin-1")[:64]
        scope[TENANT_KEY] = tenant
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

    def _authorized(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        """The tenant of the Bearer key sent, or None when it is not one of ours."""
        value = next((v for k, v in headers if k == b"authorization"), b"")
        token = value[7:] if value[:7].lower() == b"bearer " else b""
        found = None
        for key, tenant in zip(self.api_keys, self.tenants, strict=True):
            if hmac.compare_digest(token, key):  # every key compared, each in constant time
                found = tenant
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


def read_api_keys(config: MeshConfig) -> dict[str, str]:
    """EVENFLOW_API_KEYS plus the lines of EVENFLOW_API_KEY_FILE (never argv): each entry a
    key, or a key and its tenant's name after a space (`sk-abc123 team-a`); key -> tenant
    ("" where none is named)."""
    entries = list(config.api_keys)
    if config.api_key_file:
        with open(config.api_key_file) as f:
            entries += [line for line in f]
    keys: dict[str, str] = {}
    for entry in entries:
        key, _, tenant = entry.strip().partition(" ")
        if key:
            keys[key] = tenant.strip()
    return keys
