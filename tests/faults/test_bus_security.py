"""A bus nobody can forge, on the session mesh's nats-server (per-service users written by
LocalMesh): no credentials, no connection; a service's credentials allow only its own part of
the protocol (the server refuses the rest); a heartbeat naming another worker is dropped."""

from __future__ import annotations

import asyncio

import httpx
import nats
import pytest
from meshutil import API_KEY

from evenflow.proto import subjects
from evenflow.proto.messages import (
    ExpertPlacement,
    PrefillRequest,
    Role,
    SamplingSpec,
    TokenDelta,
    TokenDeltas,
    WorkerHeartbeat,
    encode,
)
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
REQUEST = PrefillRequest(request_id="forged", prompt_token_ids=[1, 2], sampling=SamplingSpec(),
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
