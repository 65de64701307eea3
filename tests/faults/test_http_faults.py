"""The HTTP edge as a careless client or an attacker meets it, against a real local mesh:
every bad value is a 400 naming its field (and the worker keeps serving), oversized bodies and
headers are refused before they cost memory, the API key is checked before the body is read."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from meshutil import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": "tiny-moe", "messages": [{"role": "user", "content": "count from 5"}],
        "max_tokens": 3}


def post(mesh, body, headers=AUTH, path="/v1/chat/completions", **kwargs):
    return httpx.post(mesh.url + path, headers=headers, timeout=30,
                      **({"json": body} if body is not None else kwargs))


@pytest.mark.parametrize("field, value", [
    ("top_k", 9223372036854775808), ("stop_token_ids", [-1]), ("stop_token_ids", [10**6]),
    ("max_tokens", "10"), ("temperature", "0.5"), ("stream", "yes"), ("logprobs", 3),
    ("top_logprobs", 21), ("best_of", 3), ("stream_options", {"include_usage": True}),
    ("seed", 2**64), ("n", 17), ("stop", ["x"] * 100_000), ("stop", [""]), ("timeout", 0),
    ("logit_bias", {"five": 10}), ("logit_bias", {"5": 101}), ("presence_penalty", 3),
    ("response_format", {"type": "yaml"}), ("tools", [{"type": "function"}]),
    ("tool_choice", "required"), ("min_tokens", 10**7), ("allowed_token_ids", []),
])
def test_bad_values_are_400_naming_the_field(mesh, field, value):
    started = time.monotonic()
    resp = post(mesh, {**CHAT, field: value})
    assert resp.status_code == 400, resp.text
    assert re.split(r"[.\[]", resp.json()["error"]["param"])[0] == field  # stop_token_ids[0]
    assert time.monotonic() - started < 5  # refused at the edge, not after work


def test_the_worker_still_serves_after_the_bad_requests(mesh):
    resp = post(mesh, {**CHAT, "temperature": 1, "top_k": 2**31 - 1, "seed": 7})
    assert resp.status_code == 200, resp.text


def test_completions_refuse_what_is_not_built(mesh):
    for field, value in (("logprobs", 21), ("suffix", "x"), ("max_tokens", 0)):
        resp = post(mesh, {"model": "tiny-moe", "prompt": "count from 5", field: value},
                    path="/v1/completions")
        assert resp.status_code == 400 and resp.json()["error"]["param"] == field


def test_an_oversized_body_is_413(mesh):
    huge = b'{"model": "tiny-moe", "prompt": "' + b"a" * (5 * 2**20) + b'"}'
    resp = post(mesh, None, headers={**AUTH, "Content-Type": "application/json"},
                path="/v1/completions", content=huge)
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "body_too_large"


def test_a_body_without_length_is_counted_as_it_arrives(mesh):
    def chunks():
        yield b'{"model": "tiny-moe", "prompt": "'
        for _ in range(80):
            yield b"a" * 65536
        yield b'"}'

    resp = post(mesh, None, headers={**AUTH, "Content-Type": "application/json"},
                path="/v1/completions", content=chunks())
    assert resp.status_code == 413


def test_oversized_headers_are_431(mesh):
    resp = post(mesh, CHAT, headers={**AUTH, "X-Padding": "a" * 100_000})
    assert resp.status_code == 431


def test_the_key_is_checked_before_the_body(mesh):
    resp = post(mesh, None, headers={"Authorization": "Bearer wrong"}, path="/v1/completions",
                content=b"{" * (3 * 2**20))
    assert resp.status_code == 401
    assert httpx.get(mesh.url + "/health").status_code == 200  # probes need no key
    assert httpx.get(mesh.url + "/openapi.json").status_code == 401
    assert httpx.get(mesh.url + "/openapi.json", headers=AUTH).status_code == 200
