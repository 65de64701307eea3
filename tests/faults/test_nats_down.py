"""NATS down when the gateway starts: the HTTP port still answers (503 until the mesh is
there) and the log says so once instead of filling with tracebacks; once NATS is up the
gateway connects by itself."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
from meshutil import wait_for

from evenflow.services.config import MeshConfig
from evenflow.services.launcher import free_port, start_nats, stop_process


def test_gateway_with_nats_down_answers_503_and_connects_later(tmp_path):
    nats_port, http_port = free_port(), free_port()
    config = MeshConfig(nats_url=f"nats://127.0.0.1:{nats_port}", port=http_port)
    log = (tmp_path / "gateway.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "evenflow.gateway"],
                            env={**config.to_env(), "PATH": ""}, stderr=log, stdout=log)
    server = None
    try:
        def health() -> int:
            try:
                return httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=1).status_code
            except httpx.HTTPError:
                return 0

        assert wait_for(lambda: health() == 503, timeout=30)
        time.sleep(3)  # an outage of a few seconds
        text = (tmp_path / "gateway.log").read_text()
        assert text.count("Traceback") == 0 and text.count("NATS unreachable") == 1
        assert text.count("NATS error") <= 2  # at most one line per 5 s
        server = start_nats(nats_port)
        assert wait_for(lambda: "connected to NATS" in (tmp_path / "gateway.log").read_text(),
                        timeout=15)
        assert health() == 503  # connected, but no workers: still not ready
    finally:
        stop_process(proc)
        log.close()
        if server is not None:
            server.stop()
