"""The gateway's fast lane: POST /v1/completions and /v1/chat/completions served past FastAPI's
and Starlette's layers (its middleware stack, router, dependency solving and exception
handlers cost ~25% of the gateway's CPU per request, by py-spy), with the same edge checks
(EdgeMiddleware), the same request models and the same handler (app.handle).

Only the happy path is taken here: a JSON object that its model validates. Anything else — a
body that is not JSON or not valid, another content type, another route or method — goes to
the FastAPI app as it came (the body replayed), so every refusal is worded as before, by the
code that words it. An APIError from the handler is answered as the app's handler answers it;
an unexpected error is a 500 in OpenAI's shape, logged with its traceback.

Off with EVENFLOW_DIRECT_STREAM=0, with the direct path (gateway/direct.py)."""

from __future__ import annotations

import logging

import orjson
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.types import Message, Receive, Scope, Send

from evenflow.gateway.admission import DEFAULT_TENANT
from evenflow.gateway.app import handle
from evenflow.gateway.edge import TENANT_KEY, EdgeMiddleware, read_api_keys
from evenflow.gateway.protocol import APIError, ChatCompletionRequest, CompletionRequest
from evenflow.gateway.responses import json_response
from evenflow.services.config import MeshConfig

log = logging.getLogger(__name__)

ROUTES: dict[str, tuple[str, type[BaseModel]]] = {
    "/v1/completions": ("completion", CompletionRequest),
    "/v1/chat/completions": ("chat", ChatCompletionRequest),
}


class FastLane:
    """ASGI app in front of the FastAPI app (`app`): the hot routes here, the rest there."""

    def __init__(self, app: FastAPI, config: MeshConfig) -> None:
        self.app = app
        self.edge = EdgeMiddleware(self._serve, config, read_api_keys(config))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in ROUTES
                and self.app.state.gateway is not None):
            await self.edge(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """After the edge's checks: the body is read (receive replays it)."""
        first = await receive()
        body = first.get("body", b"")
        kind, model = ROUTES[scope["path"]]
        request = None
        if _is_json(scope):
            try:
                data = orjson.loads(body)
                if type(data) is dict:
                    request = model.model_validate(data)
            except Exception:  # (not JSON, invalid, or a field refused outright: APIError)
                request = None
        if request is None:  # the app words the refusal
            await self.app(scope, _replay(first, receive), send)
            return
        try:
            response = await handle(self.app.state.gateway, kind, request,  # type: ignore[arg-type]
                                    scope.get(TENANT_KEY, DEFAULT_TENANT))
        except APIError as exc:
            response = json_response(exc.body(), exc.status, exc.headers)
        except Exception:
            log.exception("request to %s failed", scope["path"])
            response = json_response(APIError(
                500, "The server had an error while processing your request.", "server_error",
                code="internal_error").body(), 500)
        await response(scope, receive, send)


def _is_json(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value.split(b";", 1)[0].strip().lower() == b"application/json"
    return False


def _replay(first: Message, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return first
        return await receive()

    return replay
