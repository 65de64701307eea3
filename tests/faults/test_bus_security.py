"""A bus nobody can forge, on the session mesh's nats-server (per-service users written by
LocalMesh): no credentials, no connection; a service's credentials allow only its own part of
the protocol (the server refuses the rest); a heartbeat naming another worker is dropped."""

from __future__ import annotations

import asyncio

import httpx
import nats
import orjson
import pytest
from meshutil import API_KEY

from evenflow.proto import subjects
from evenflow.proto.messages import (
    ExpertPlacement,
    PrefillRequest,
    Role,
    TokenDelta,
    TokenDeltas,
    WorkerHeartbeat,
    encode,
)
from evenflow.proto.sampling import SamplingParams
from evenflow.services.nats_auth import read_credentials


def nats_url(mesh) -> str:
    return mesh.config.nats_url


def test_no_credentials_no_connection(mesh):
    async def attempt() -> None:
        await nats.connect(nats_url(mesh), allow_reconnect=False, max_reconnect_attempts=0,
                           connect_timeout=3)

    with pytest.raises(Exception, match="(?i)authorization|no servers"):
        asyncio.run(attempt())


def connect_as(mesh, role: str, worker_id: str, errors: list[str]):
    user, password = read_credentials(mesh.credentials[(role, worker_id)])

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    return nats.connect(nats_url(mesh), user=user, password=password, error_cb=on_error,
                        allow_reconnect=False)


def refused(mesh, role: str, worker_id: str, subject: str, message) -> tuple[bool, list[str]]:
    """Publish `message` on `subject` as that service; whether an admin listener got it, and
    the errors the server sent back."""
    errors: list[str] = []

    async def scenario() -> bool:
        watcher = await nats.connect(mesh.admin_nats_url)
        sub = await watcher.subscribe(subject)
        sender = await connect_as(mesh, role, worker_id, errors)
        payload = encode(message)
        await sender.publish(subject, payload)
        await sender.flush()
        delivered = False  # others may publish here legitimately (the balancer re-announces)
        deadline = asyncio.get_running_loop().time() + 1.0
        while not delivered and asyncio.get_running_loop().time() < deadline:
            try:
                delivered = (await sub.next_msg(timeout=0.2)).data == payload
            except nats.errors.TimeoutError:
                pass
        await asyncio.sleep(0.2)  # the server's -ERR arrives asynchronously
        await sender.close()
        await watcher.close()
        return delivered

    return asyncio.run(scenario()), errors


PLACEMENT = ExpertPlacement(version=99, num_layers=1, num_slots=1, phy2log=[0], shares=[1.0])
REQUEST = PrefillRequest(request_id="forged", prompt_token_ids=[1, 2], sampling=SamplingParams(),
                         reply_subject=subjects.gateway_inbox("x"), decode_worker="d0",
                         enqueued_at=0.0)


def test_the_gateway_cannot_publish_a_placement(mesh):
    delivered, errors = refused(mesh, "gateway", "gateway", subjects.EXPERT_PLACEMENT, PLACEMENT)
    assert not delivered and any("permissions violation" in e.lower() for e in errors)


def test_a_worker_cannot_publish_requests(mesh):
    delivered, errors = refused(mesh, "decode", "d0", subjects.prefill_worker("p0"), REQUEST)
    assert not delivered and any("permissions violation" in e.lower() for e in errors)


def test_the_gateway_cannot_answer_for_a_worker(mesh):
    deltas = TokenDeltas(worker_id="d0", deltas=[TokenDelta(request_id="r", token_ids=[1],
                                                            finish_reason="stop")])
    delivered, _ = refused(mesh, "gateway", "gateway", subjects.gateway_inbox("victim"), deltas)
    assert not delivered


def test_a_worker_heartbeats_only_on_its_own_subject(mesh):
    fake = WorkerHeartbeat(worker_id="d9", role=Role.DECODE, model="tiny-moe",
                           free_kv_blocks=10**6, total_kv_blocks=10**6, epoch="x")
    delivered, _ = refused(mesh, "decode", "d0", subjects.heartbeat(Role.DECODE, "d9"), fake)
    assert not delivered


def test_a_heartbeat_naming_another_worker_is_dropped(mesh):
    """Even with full rights on the bus, a heartbeat on a subject not its own steers nothing."""
    async def forge() -> None:
        nc = await nats.connect(mesh.admin_nats_url)
        fake = WorkerHeartbeat(worker_id="ghost", role=Role.DECODE, model="tiny-moe",
                               free_kv_blocks=10**6, total_kv_blocks=10**6, epoch="x")
        for _ in range(5):
            await nc.publish(subjects.heartbeat(Role.DECODE, "d0"), encode(fake))
            await asyncio.sleep(0.1)
        await nc.close()

    asyncio.run(forge())
    health = httpx.get(mesh.url + "/health").json()
    assert health["workers"]["decode"] == 1
    resp = httpx.post(mesh.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": "tiny-moe", "prompt": "count from 5 :", "max_tokens": 2},
                      timeout=30)
    assert resp.status_code == 200


def forge_replies(mesh, body: dict, forged) -> httpx.Response | list[bytes]:
    """Send `body` to the gateway while a client holding decode worker d0's credentials (its
    own rights: read d0's requests, answer gateways) replies first with forged(request) ->
    messages. The non-streamed response, or a stream's data lines."""
    from concurrent.futures import ThreadPoolExecutor

    from evenflow.proto.messages import DecodeRequest, decode

    async def forger() -> None:
        nc = await connect_as(mesh, "decode", "d0", [])
        sub = await nc.subscribe(subjects.decode_worker("d0"))
        while True:
            request = decode((await sub.next_msg(timeout=30)).data)
            if isinstance(request, DecodeRequest):
                for message in forged(request):
                    await nc.publish(request.reply_subject, encode(message))
                await nc.flush()
                await nc.close()
                return

    def call():
        headers = {"Authorization": f"Bearer {API_KEY}"}
        if body.get("stream"):
            with httpx.stream("POST", mesh.url + "/v1/completions", json=body, headers=headers,
                              timeout=60) as resp:
                return [line.encode() for line in resp.iter_lines() if line.startswith("data:")]
        return httpx.post(mesh.url + "/v1/completions", json=body, headers=headers, timeout=60)

    with ThreadPoolExecutor(1) as pool:
        loop = asyncio.new_event_loop()
        listening = loop.create_task(forger())
        loop.run_until_complete(asyncio.sleep(0.3))  # subscribed before the request goes out
        answer = pool.submit(call)
        loop.run_until_complete(listening)
        loop.close()
        return answer.result()


LONG_BODY = {"model": "tiny-moe", "prompt": "count from 5 :", "max_tokens": 300,
             "ignore_eos": True}


def forged_error(request):
    from evenflow.proto.messages import ErrorMessage

    return [ErrorMessage(request_id=request.request_id, code="made_up", retryable=False,
                         description="forged " + "x" * 5000, worker_id="d0")]


def forged_token(request):
    return [TokenDeltas(worker_id="d0", deltas=[TokenDelta(
        request_id=request.request_id, token_ids=[10**9])])]  # (unordered: taken at once)


@pytest.mark.parametrize("forged", [forged_error, forged_token])
def test_a_forged_reply_is_a_502_or_an_error_event_never_a_500(mesh, forged):
    """docs/reliability.md's security section: a worker's credentials reach that worker's own
    streams. What it sends is checked like any upstream answer: an error becomes a 502 (an
    error event when streaming), a token outside the vocabulary ends the request the same way."""
    resp = forge_replies(mesh, LONG_BODY, forged)
    assert resp.status_code == 502, (resp.status_code, resp.text[:300])
    assert resp.json()["error"]["type"] == "upstream_error"
    assert len(resp.json()["error"]["message"]) < 1200  # a forged essay is cut short
    events = forge_replies(mesh, {**LONG_BODY, "stream": True}, forged)
    assert events[-1] == b"data: [DONE]"
    assert "error" in orjson.loads(events[-2].removeprefix(b"data: "))
