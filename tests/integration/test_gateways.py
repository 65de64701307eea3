"""Several gateway processes on one HTTP port (`evenflow up --gateways 2`): new connections are
spread over them, each one serves requests end to end (its own NATS inbox), each has its own
metrics port, and killing one leaves the port serving."""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest
from meshutil import running_mesh

from evenflow.services.config import MeshConfig

pytestmark = pytest.mark.slow

_SUCCESS = re.compile(r'^vllm:request_success_total\{[^}]*\} (\S+)$', re.M)


def served(metrics_url: str) -> float:
    return sum(float(n) for n in _SUCCESS.findall(httpx.get(metrics_url, timeout=10).text))


@pytest.fixture(scope="module")
def two_gateways():
    with running_mesh(MeshConfig(port=0, engine="mock", num_prefill=0, num_decode=1,
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


def test_the_port_keeps_serving_when_one_gateway_dies(two_gateways):
    gateways = [p for p in two_gateways.procs if "evenflow.gateway" in " ".join(p.args)]
    gateways[0].send_signal(signal.SIGKILL)
    gateways[0].wait(10)
    time.sleep(0.5)
    assert [complete(two_gateways.url) for _ in range(8)] == [200] * 8
