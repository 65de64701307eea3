"""A real local mesh for the integration tests: nats-server, redis-server, gateway, one prefill
and one decode worker as processes, exporting traces over OTLP to an in-test receiver."""

from __future__ import annotations

import pytest
from meshutil import API_KEY  # noqa: F401 (re-exported for tests)
from otlp_receiver import OTLPReceiver

from evenflow.services.config import MeshConfig
from evenflow.services.launcher import LocalMesh


@pytest.fixture(scope="session")
def otlp():
    receiver = OTLPReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def mesh(otlp):
    config = MeshConfig(port=0, api_keys=(API_KEY,), local_prefill_threshold=16,
                        heartbeat_interval_s=0.2, worker_timeout_s=2.0)
    running = LocalMesh(config)
    running.start(env={"OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint,
                       "OTEL_BSP_SCHEDULE_DELAY": "100"}, health_timeout_s=180)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def client(mesh):
    from openai import OpenAI

    return OpenAI(base_url=mesh.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def offline():
    from evenflow import LLM

    return LLM("tiny-moe")
