"""Bad requests get OpenAI-style errors with the right status; garbage on the wire is dropped
while the services keep serving."""

from __future__ import annotations

import asyncio

import httpx
import msgpack
import nats
import pytest
from meshutil import API_KEY

from evenflow.proto import subjects

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"model": "tiny-moe", "messages": [{"role": "user", "content": "count from 5"}],
        "max_tokens": 3}


def post(mesh, path, body, headers=AUTH):
    kwargs = {"content": body} if isinstance(body, (str, bytes)) else {"json": body}
    return httpx.post(mesh.url + path, headers={**headers, "Content-Type": "application/json"},
                      timeout=30, **kwargs)


def assert_error(resp, status, param=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param:
        assert err["param"] == param


@pytest.mark.parametrize("body, param", [
    ("{not json", None),
    ('{"model": "tiny-moe", "messages": [{"role": "user", "content": "hi"}], '
     '"temperature": NaN}', None),  # not JSON (the stdlib's parser would take it)
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({"messages": CHAT["messages"]}, "model"),
    ({"model": "tiny-moe"}, "messages"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "temperature": -0.5}, "temperature"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "top_p": 1.5}, "top_p"),
    ({**CHAT, "messages": [{"role": "user", "content": " ".join(["count"] * 600)}]}, "messages"),
])
def test_bad_chat_requests_are_400(mesh, body, param):
    assert_error(post(mesh, "/v1/chat/completions", body), 400, param)


def test_bad_completion_requests(mesh):
    base = {"model": "tiny-moe", "prompt": "count from 3 :", "max_tokens": 3}
    assert_error(post(mesh, "/v1/completions", {**base, "prompt": [1, 999999]}), 400, "prompt")
    # the prompt fits: the output length asked for is at fault, not the prompt
    assert_error(post(mesh, "/v1/completions", {**base, "max_tokens": 100000}), 400, "max_tokens")
    assert_error(post(mesh, "/v1/completions", {**base, "model": "gpt-9"}), 404, "model")
    ok = post(mesh, "/v1/completions", {**base, "unknown_field": 1, "logit_bias": {}})
    assert ok.status_code == 200  # unknown extra fields are ignored


def test_api_key_is_required_except_for_health(mesh):
    assert_error(post(mesh, "/v1/chat/completions", CHAT, headers={}), 401)
    assert_error(post(mesh, "/v1/chat/completions", CHAT,
                      headers={"Authorization": "Bearer wrong"}), 401)
    assert httpx.get(mesh.url + "/health").status_code == 200


def test_garbage_on_every_subject_leaves_the_mesh_serving(mesh, client):
    async def spray() -> None:
        nc = await nats.connect(mesh.admin_nats_url)
        payloads = [b"\x00garbage", b"", msgpack.packb({"t": "prefill_request", "v": 99, "d": []}),
                    msgpack.packb({"t": "kv_chunk", "v": 1, "d": ["r", "x", 0, 0, b""]}),
                    msgpack.packb({"t": "no_such_type", "v": 1, "d": []})]
        for subject in (subjects.prefill_worker("p0"), subjects.decode_worker("d0"),
                        subjects.heartbeat("decode", "d0"), subjects.gateway_inbox("nobody")):
            for payload in payloads:
                await nc.publish(subject, payload)
        await nc.flush()
        await nc.close()

    asyncio.run(spray())
    out = client.completions.create(model="tiny-moe", prompt="count from 40 : 40 41 42 43 44 "
                                    "45 46 47 48 49 50 51 52 53", max_tokens=3, temperature=0)
    assert out.choices[0].text.split() == ["54", "55", "56"]
    assert httpx.get(mesh.url + "/metrics").status_code == 401  # behind the key by default
    metrics = httpx.get(mesh.url + "/metrics", headers=AUTH).text
    assert "evenflow_messages_dropped_total" in metrics


def test_every_refusal_is_counted_by_code_route_and_reason(mesh):
    """Refusals show in the gateway's metrics (summed over its gateway processes)."""
    import re

    def counts() -> tuple[float, float, float]:
        text = httpx.get(mesh.url + "/metrics", headers=AUTH, timeout=10).text

        def value(pattern: str) -> float:
            return sum(float(v) for v in re.findall(pattern + r" (\S+)$", text, re.M))

        return (value(r'^evenflow_refusals_total\{reason="model_not_found"\}'),
                value(r'^evenflow_http_requests_total\{code="404",route="/v1/chat/completions"\}'),
                value(r'^evenflow_refusals_total\{reason="invalid_api_key"\}'))

    before = counts()
    assert_error(post(mesh, "/v1/chat/completions", {**CHAT, "model": "nope"}), 404)
    assert post(mesh, "/v1/chat/completions", CHAT, headers={
        "Authorization": "Bearer wrong"}).status_code == 401
    after = counts()
    assert [b - a for a, b in zip(before, after, strict=True)] == [1, 1, 1], (before, after)
