"""Cancellation, tracing across processes, and a worker dying mid-stream."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import nats
import pytest
from meshutil import API_KEY

from evenflow.proto import subjects
from evenflow.proto.messages import WorkerHeartbeat, decode
from evenflow.services.config import MeshConfig
from evenflow.services.launcher import LocalMesh

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG_PROMPT = "count from 200 : " + " ".join(str(i) for i in range(200, 214))  # remote prefill


def decode_heartbeat(nats_url: str) -> WorkerHeartbeat:
    async def one() -> WorkerHeartbeat:
        nc = await nats.connect(nats_url)
        sub = await nc.subscribe(subjects.HEARTBEATS)
        try:
            while True:
                msg = decode((await sub.next_msg(timeout=5)).data)
                if isinstance(msg, WorkerHeartbeat) and msg.worker_id == "d0":
                    return msg
        finally:
            await nc.close()

    return asyncio.run(one())


def test_client_disconnect_cancels_and_frees_kv(mesh):
    body = {"model": "tiny-moe", "prompt": LONG_PROMPT, "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", mesh.url + "/v1/completions", json=body, headers=AUTH,
                      timeout=30) as resp:
        lines = resp.iter_lines()
        got = [line for line, _ in zip(lines, range(8), strict=False) if line.startswith("data:")]
        assert len(got) >= 3
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        hb = decode_heartbeat(mesh.admin_nats_url)
        if hb.running == 0 and hb.waiting == 0 and hb.free_kv_blocks == hb.total_kv_blocks:
            return
        time.sleep(0.2)
    pytest.fail(f"decode worker still busy after the client left: {hb}")


def test_one_trace_spans_gateway_prefill_and_decode(mesh, client, otlp):
    fresh = "count from 300 : " + " ".join(str(i) for i in range(300, 314))  # cached nowhere
    out = client.completions.create(model="tiny-moe", prompt=fresh, max_tokens=4, temperature=0)
    wanted = {"gateway.request", "route", "stream", "prefill.queue", "prefill.compute",
              "kv_transfer", "decode.kv_receive", "decode.queue", "decode.generate"}
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        roots = [s for s in otlp.spans if s.name == "gateway.request"
                 and s.attributes.get("gen_ai.request.id") == out.id]
        spans = [s for s in otlp.spans if roots and s.trace_id == roots[0].trace_id]
        if wanted <= {s.name for s in spans}:
            break
        time.sleep(0.2)
    names = {s.name for s in spans}
    assert wanted <= names, f"missing spans: {wanted - names}"
    by_id = {s.span_id: s for s in spans}
    root = next(s for s in spans if not s.parent_span_id)  # the HTTP server span
    assert root.service == "evenflow-gateway"
    for s in spans:
        if s is root:
            continue
        assert s.parent_span_id in by_id, f"{s.name} has a parent outside the trace"
        hop = s
        while hop.parent_span_id:  # every span leads back to the gateway's request span
            hop = by_id[hop.parent_span_id]
        assert hop is root
    services = {s.name: s.service for s in spans}
    assert services["prefill.compute"] == "evenflow-prefill"
    assert services["decode.generate"] == "evenflow-decode"
    transfer = next(s for s in spans if s.name == "kv_transfer")
    assert transfer.attributes["evenflow.kv.bytes"] > 0


@pytest.fixture
def small_mesh():
    # (no supervisor: a dead worker stays dead; a stream waits 1 s for one to come back)
    running = LocalMesh(MeshConfig(port=0, heartbeat_interval_s=0.2, worker_timeout_s=1.5,
                                   local_prefill_threshold=16, migration_wait_s=1.0))
    running.start(health_timeout_s=180)
    yield running
    running.stop()


def test_decode_worker_dying_mid_stream_ends_the_stream_with_an_error(small_mesh):
    body = {"model": "tiny-moe", "prompt": LONG_PROMPT, "max_tokens": 450, "ignore_eos": True,
            "temperature": 0, "stream": True}
    decode_proc = small_mesh.procs[0]  # d0 is started first
    assert decode_proc.args[-1] == "d0"
    started = time.monotonic()
    with httpx.stream("POST", small_mesh.url + "/v1/completions", json=body, timeout=30) as resp:
        events = []
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            events.append(line)
            if len(events) == 3:
                decode_proc.send_signal(signal.SIGKILL)
    assert events[-1] == "data: [DONE]"
    assert '"error"' in events[-2]
    assert time.monotonic() - started < 15  # bounded: the heartbeat timeout, not a hang
