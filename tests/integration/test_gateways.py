"""Several gateway processes on one HTTP port (`evenflow up --gateways 2`): new connections are
spread over them, each one serves requests end to end (its own NATS inbox), each has its own
metrics port, and killing one leaves the port serving."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
import pytest
from meshutil import supervised_mesh

from evenflow.services.config import MeshConfig

pytestmark = pytest.mark.slow

_SUCCESS = re.compile(r'^vllm:request_success_total\{[^}]*\} (\S+)$', re.M)


def served(metrics_url: str) -> float:
    return sum(float(n) for n in _SUCCESS.findall(httpx.get(metrics_url, timeout=10).text))


@pytest.fixture(scope="module")
def two_gateways():
    with supervised_mesh(MeshConfig(port=0, engine="mock", num_prefill=0, num_decode=1,
                                    num_ep_ranks=0, num_gateways=2, heartbeat_interval_s=0.2),
                         health_timeout_s=120) as mesh:
        yield mesh


def complete(url: str) -> int:
    with httpx.Client(timeout=60) as fresh:  # a new connection: the kernel picks a gateway
        return fresh.post(url + "/v1/completions", json={
            "model": "tiny-moe", "prompt": "count from 5 :", "max_tokens": 3}).status_code


def test_connections_spread_over_gateway_processes(two_gateways):
    urls = {name: url for name, url in two_gateways.metrics_urls().items()
            if name.startswith("gateway")}
    assert sorted(urls) == ["gateway-g0", "gateway-g1"]
    assert [complete(two_gateways.url) for _ in range(24)] == [200] * 24
    counts = {name: served(url) for name, url in urls.items()}
    assert sum(counts.values()) == 24
    assert all(n > 0 for n in counts.values()), f"requests per gateway process: {counts}"


def test_the_shared_port_metrics_sum_every_gateway(two_gateways):
    """/metrics on the port answers for all the gateways, whichever one it lands on (vLLM's
    API servers alike); each one's own port for itself."""
    urls = [url for name, url in two_gateways.metrics_urls().items()
            if name.startswith("gateway")]
    assert [complete(two_gateways.url) for _ in range(6)] == [200] * 6
    alone = sum(served(url) for url in urls)
    for _ in range(4):  # new connections: either process answers
        assert served(two_gateways.url + "/metrics") == alone


def stream_text(url: str, max_tokens: int) -> tuple[str, set[int]]:
    """A streamed completion on a new connection: its text and the `created` of its chunks;
    raises httpx errors (a gateway killed under it)."""
    text, created = "", set()
    with httpx.Client(timeout=60) as fresh, fresh.stream("POST", url + "/v1/completions", json={
            "model": "tiny-moe", "prompt": "count from 5 :", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line.removeprefix("data: "))
        text += chunk["choices"][0]["text"]
        created.add(chunk["created"])
    return text, created


def test_streams_through_every_gateway_match_the_whole_answer(two_gateways):
    """The direct path (gateway/direct.py) writes a stream's middle events: what streams is
    the non-streamed answer, on whichever gateway the connection lands."""
    with httpx.Client(timeout=60) as client:
        whole = client.post(two_gateways.url + "/v1/completions", json={
            "model": "tiny-moe", "prompt": "count from 5 :", "max_tokens": 24,
            "ignore_eos": True}).json()["choices"][0]["text"]
    for _ in range(6):
        text, created = stream_text(two_gateways.url, 24)
        assert text == whole and len(created) == 1


def test_a_gateway_killed_under_load_loses_only_its_streams_and_comes_back(two_gateways):
    gateways = [p for p in two_gateways.procs if "evenflow.gateway" in " ".join(p.args)]
    outcomes: list[str] = []

    def one() -> None:
        try:
            stream_text(two_gateways.url, 400)
            outcomes.append("done")
        except (httpx.HTTPError, AssertionError) as exc:  # the killed gateway's streams
            outcomes.append(type(exc).__name__)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    gateways[0].send_signal(signal.SIGKILL)
    gateways[0].wait(10)
    for t in threads:
        t.join(90)
    assert not any(t.is_alive() for t in threads), "a stream hung after its gateway died"
    assert len(outcomes) == 8
    assert [complete(two_gateways.url) for _ in range(8)] == [200] * 8  # the other serves
    deadline = time.monotonic() + 60  # the supervisor restarts the killed one
    urls = {name: url for name, url in two_gateways.metrics_urls().items()
            if name.startswith("gateway")}
    while time.monotonic() < deadline:
        restarted = [p for p in two_gateways.procs if "evenflow.gateway" in " ".join(p.args)
                     and p.poll() is None]
        if len(restarted) == 2 and all(_answers(u) for u in urls.values()):
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the killed gateway was not restarted")
    assert [complete(two_gateways.url) for _ in range(8)] == [200] * 8


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
