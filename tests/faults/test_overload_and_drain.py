"""Overload, deadlines and shutdown at the gateway, on a mock-engine mesh of real processes:
past the admission queue a request gets 429 with Retry-After before any stream starts; a
request past its deadline gets 504 (an error event once streaming) and is dropped by the
workers; SIGTERM drains: new requests 503, running streams end with an error event and
[DONE] when the drain time is up, and the process exits by itself."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import httpx
import orjson
import pytest
from meshutil import running_mesh

from evenflow.services.config import MeshConfig

pytestmark = pytest.mark.slow

LONG = {"model": "tiny-moe", "prompt": "count from 5 :", "max_tokens": 400, "ignore_eos": True,
        "temperature": 0}


@pytest.fixture(scope="module")
def small_mesh():
    config = MeshConfig(port=0, engine="mock", num_prefill=0, num_decode=1, num_ep_ranks=0,
                        max_inflight=1, max_queued=1, drain_timeout_s=1.0,
                        debug_step_delay_ms="10",  # 480 tokens: 4.8 s at least
                        heartbeat_interval_s=0.2, worker_timeout_s=3.0)
    with running_mesh(config, health_timeout_s=120) as mesh:
        yield mesh


def stream_events(url: str, body: dict, timeout: float = 60) -> tuple[int, list[bytes]]:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=timeout) as resp:
        if resp.status_code != 200:
            resp.read()
            return resp.status_code, [resp.content]
        return 200, [line.encode() for line in resp.iter_lines() if line.startswith("data:")]


def test_past_the_queue_requests_get_429_with_retry_after(small_mesh):
    url = small_mesh.url
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        running = pool.submit(stream_events, url, LONG)
        time.sleep(0.5)  # it holds the one slot
        queued = pool.submit(stream_events, url, {**LONG, "max_tokens": 5})
        time.sleep(0.3)  # it holds the one queue place
        refused = [httpx.post(url + "/v1/completions", json=LONG, timeout=10)
                   for _ in range(3)]
        assert all(r.status_code == 429 for r in refused), [
            (r.status_code, r.text[:300]) for r in refused]
        assert all(r.headers.get("retry-after") == "1" for r in refused)
        assert refused[0].json()["error"]["type"] == "rate_limit_error"
        assert running.result()[0] == 200 and queued.result()[0] == 200
    assert httpx.post(url + "/v1/completions", json={**LONG, "max_tokens": 3},
                      timeout=30).status_code == 200  # slots came back


def test_a_request_past_its_deadline_is_504(small_mesh):
    started = time.monotonic()
    resp = httpx.post(small_mesh.url + "/v1/completions", json={**LONG, "timeout": 0.5},
                      timeout=30)
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "timeout"
    assert time.monotonic() - started < 5
    status, events = stream_events(small_mesh.url, {**LONG, "timeout": 0.5})
    assert status == 200 and events[-1] == b"data: [DONE]"
    error = orjson.loads(events[-2].removeprefix(b"data: "))
    assert error["error"]["code"] == "timeout"
    # The worker dropped it: the next request is served at once.
    assert httpx.post(small_mesh.url + "/v1/completions", json={**LONG, "max_tokens": 3},
                      timeout=30).status_code == 200


def test_sigterm_drains_the_gateway(small_mesh):
    """A stream outlasting the drain window ends with an error event and [DONE] when the
    window closes (not when the process is torn down later, with neither)."""
    gateway = small_mesh.procs[-1]  # spawned last
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        stream = pool.submit(stream_events, small_mesh.url, {**LONG, "max_tokens": 480})
        time.sleep(0.5)
        assert not stream.done(), stream.result()
        gateway.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.2)
        refused = httpx.post(small_mesh.url + "/v1/completions", json=LONG, timeout=10)
        assert refused.status_code == 503 and refused.headers.get("retry-after")
        status, events = stream.result()
        ended = time.monotonic() - signalled
    assert status == 200 and events[-1] == b"data: [DONE]"
    last = orjson.loads(events[-2].removeprefix(b"data: "))
    assert last.get("error", {}).get("code") == "draining", last
    assert ended < 1.0 + 2.0, ended  # the drain window (1 s) and a little
    assert gateway.wait(15) == 0
