"""Every HTTP response the gateway gives, counted: `evenflow_http_requests_total{code,route}`
(route: the path where it is one of the gateway's own, else "other", so a scan of random paths
cannot grow the metric), and every refusal (status 400 and up, probes' 503s aside) by its
reason, `evenflow_refusals_total{reason}`: the error body's `code` (invalid_value,
model_not_found, tenant_over_share, body_too_large, ...), else its `type`, else the status.

Pure ASGI, outermost: in front of the fast lane in the gateway process (gateway/__main__.py)
and inside the FastAPI app (gateway/app.py, for Ray Serve); whichever sees a request first
counts it, the other passes it on. A streamed response that fails after its head counts as
its status (200); its error event is the workers' failure, counted by the request metrics."""

from __future__ import annotations

from collections.abc import Iterable

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from evenflow.services.metrics import HTTP_REQUESTS, REFUSALS, labelled

_COUNTED = "evenflow.counted"


def refusal_reason(body: bytes, status: int) -> str:
    """An error body's code (or type), as OpenAI's error shape carries it."""
    try:
        error = orjson.loads(body).get("error") or {}
    except (orjson.JSONDecodeError, AttributeError):
        return str(status)
    reason = error.get("code") or error.get("type") if isinstance(error, dict) else None
    return reason if isinstance(reason, str) and len(reason) <= 64 else str(status)


def app_routes(router: object) -> list[str]:
    """The paths a router serves, for `CountResponses`."""
    return [path for r in getattr(router, "routes", [])
            if isinstance(path := getattr(r, "path", None), str)]


# probes, not requests: their 503s (not ready yet) are counted as responses, not refusals
_PROBES = frozenset({"/health", "/live"})


class CountResponses:
    def __init__(self, app: ASGIApp, routes: Iterable[str]) -> None:
        self.app, self.routes = app, frozenset(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get(_COUNTED):
            await self.app(scope, receive, send)
            return
        scope[_COUNTED] = True
        route = scope.get("path", "") if scope.get("path") in self.routes else "other"
        status = 0
        body = b""

        async def counting(message: Message) -> None:
            nonlocal status, body
            if message["type"] == "http.response.start":
                status = message["status"]
                labelled(HTTP_REQUESTS, str(status), route).inc()
            elif message["type"] == "http.response.body" and status >= 400 \
                    and route not in _PROBES:
                body += message.get("body", b"")
                if not message.get("more_body") or len(body) > 4096:
                    labelled(REFUSALS, refusal_reason(body, status)).inc()
                    status = 0  # (counted once)
            await send(message)

        await self.app(scope, receive, counting)
