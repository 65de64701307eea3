"""Shared fixtures: a real local mesh (nats-server, redis-server, gateway, one prefill and one
decode worker as processes) exporting traces to an in-test OTLP receiver, started once per
session for tests/integration and tests/faults, and stopped at the end even on failure."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "integration"))

from meshutil import API_KEY  # noqa: E402
from otlp_receiver import OTLPReceiver  # noqa: E402

from evenflow.services.config import MeshConfig  # noqa: E402
from evenflow.services.launcher import LocalMesh  # noqa: E402


@pytest.fixture(autouse=True)
def _amx_tiles_back():
    """A deterministic engine switches the AMX tiles off process-wide until it is closed;
    tests rarely close theirs, so each test hands the tiles back when it ends."""
    yield
    from evenflow.engine.kernels import native

    native.release_rows_invariant(everyone=True)


@pytest.fixture(scope="session")
def otlp():
    receiver = OTLPReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def mesh(otlp):
    # two gateway processes on the port (what `up` runs on a larger machine): every test of
    # the shared mesh goes through whichever one the connection lands on
    config = MeshConfig(port=0, api_keys=(API_KEY,), local_prefill_threshold=16,
                        heartbeat_interval_s=0.2, worker_timeout_s=2.0, num_gateways=2)
    running = LocalMesh(config)
    try:
        running.start(env={"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
                           "OTEL_BSP_SCHEDULE_DELAY": "100"}, health_timeout_s=180)
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def client(mesh):
    from openai import OpenAI

    return OpenAI(base_url=mesh.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def offline():
    from evenflow import LLM

    return LLM("tiny-moe")
