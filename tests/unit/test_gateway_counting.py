"""Every response the gateway gives is counted by status and route, every refusal by its error
code (gateway/counting.py); a path that is not the gateway's counts as "other", and a request
seen by two counters (the one in front of the fast lane, the one in the app) counts once."""

from __future__ import annotations

import asyncio

import orjson

from evenflow.gateway.counting import CountResponses, refusal_reason
from evenflow.services.metrics import HTTP_REQUESTS, REFUSALS


def _value(metric, *labels: str) -> float:
    return metric.labels(*labels)._value.get()


async def _app(scope, receive, send) -> None:
    status = 200 if scope["path"] == "/v1/models" else 400
    body = b"{}" if status == 200 else orjson.dumps(
        {"error": {"message": "no", "type": "invalid_request_error", "code": "invalid_value"}})
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": body[:5], "more_body": True})
    await send({"type": "http.response.body", "body": body[5:]})


def _call(app, path: str) -> None:
    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(_message) -> None:
        return None

    asyncio.run(app({"type": "http", "path": path, "method": "GET"}, receive, send))


def test_responses_and_refusals_are_counted_once_by_route_and_reason():
    routes = ["/v1/models", "/v1/completions"]
    app = CountResponses(CountResponses(_app, routes), routes)  # (lane's and the app's)
    before = (_value(HTTP_REQUESTS, "200", "/v1/models"),
              _value(HTTP_REQUESTS, "400", "/v1/completions"),
              _value(HTTP_REQUESTS, "400", "other"), _value(REFUSALS, "invalid_value"))
    _call(app, "/v1/models")
    _call(app, "/v1/completions")
    _call(app, "/wp-admin/setup.php")
    after = (_value(HTTP_REQUESTS, "200", "/v1/models"),
             _value(HTTP_REQUESTS, "400", "/v1/completions"),
             _value(HTTP_REQUESTS, "400", "other"), _value(REFUSALS, "invalid_value"))
    assert [b - a for a, b in zip(before, after, strict=True)] == [1, 1, 1, 2]


def test_a_refusal_reason_is_the_code_else_the_type_else_the_status():
    assert refusal_reason(b'{"error": {"code": "model_not_found"}}', 404) == "model_not_found"
    assert refusal_reason(b'{"error": {"code": null, "type": "overloaded_error"}}', 503) == \
        "overloaded_error"
    assert refusal_reason(b"not json", 413) == "413"
