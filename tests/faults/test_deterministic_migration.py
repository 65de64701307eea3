"""Deterministic mode through the mesh (`evenflow up --deterministic`, the engine in bf16
where the CPU has it): kill -9 the decode worker serving a long greedy stream; the stream
moves to the other decode worker, which re-prefills the prompt and the text so far, and its
final text equals the fault-free run's, all 450 tokens of it."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import nats
import orjson
import pytest
from meshutil import running_mesh

from evenflow.proto import subjects
from evenflow.proto.messages import Role, WorkerHeartbeat, decode
from evenflow.services.config import MeshConfig

pytestmark = pytest.mark.slow

BODY = {"model": "tiny-moe", "prompt": "count from 200 : " + " ".join(map(str, range(200, 214))),
        "max_tokens": 450, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def mesh():
    config = MeshConfig(port=0, num_prefill=1, num_decode=2, deterministic=True,
                        heartbeat_interval_s=0.2, worker_timeout_s=1.5, migration_wait_s=5.0,
                        debug_step_delay_ms="8")  # a stream of ~4 s: time to kill mid-way
    with running_mesh(config, health_timeout_s=180) as running:
        yield running


def busy_decode_worker(mesh) -> str:
    """The decode worker whose heartbeat says it runs a request."""
    async def find() -> str:
        nc = await nats.connect(mesh.admin_nats_url or mesh.config.nats_url)
        sub = await nc.subscribe(subjects.heartbeat(Role.DECODE, "*"))
        try:
            while True:
                beat = decode((await sub.next_msg(timeout=5)).data)
                if isinstance(beat, WorkerHeartbeat) and beat.running > 0:
                    return beat.worker_id
        finally:
            await nc.close()

    return asyncio.run(find())


def test_a_migrated_stream_keeps_the_fault_free_text(mesh):
    expected = httpx.post(mesh.url + "/v1/completions", json=BODY, timeout=60).json()
    expected_text = expected["choices"][0]["text"]
    assert expected["usage"]["completion_tokens"] == 450
    text, error, killed = [], None, None
    started = time.monotonic()
    with httpx.stream("POST", mesh.url + "/v1/completions", json={**BODY, "stream": True},
                      timeout=60) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line.removeprefix("data: "))
            if "error" in event:
                error = event["error"]
                continue
            text.append(event["choices"][0]["text"])
            if killed is None and len(text) == 100:
                killed = busy_decode_worker(mesh)
                proc = next(p for p in mesh.procs if p.args[-1] == killed)
                proc.send_signal(signal.SIGKILL)
    assert killed is not None and error is None, error
    assert "".join(text) == expected_text
    assert time.monotonic() - started < 45
