"""`evenflow up` restarts what dies and keeps serving: a killed worker, the KV index or
nats-server come back (the server on the same port) and requests succeed again; a child that
keeps crashing is given up on, with a message. The API key never reaches a child's
environment or command line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from meshutil import supervised_mesh, wait_for

from evenflow.services.config import MeshConfig
from evenflow.services.supervisor import (
    EXIT_PLANNED_RESTART,
    GaveUp,
    RestartPolicy,
    Supervisor,
)

pytestmark = pytest.mark.slow
KEY = "supervised-key"


def test_supervisor_backs_off_and_gives_up():
    reports: list[str] = []
    supervisor = Supervisor(RestartPolicy(max_crashes=2, window_s=60, backoff_s=0.1),
                            reports.append)
    child = supervisor.add("crasher", lambda: subprocess.Popen(
        [sys.executable, "-c", "raise SystemExit(3)"]))
    with pytest.raises(GaveUp, match="crasher failed 3 times"):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            supervisor.check()
            time.sleep(0.02)
    assert child.restarts == 2
    assert any("restarting in 0.1 s" in r for r in reports)
    assert any("restarting in 0.2 s" in r for r in reports)  # doubled


def test_a_planned_restart_is_not_a_crash():
    """A worker that asks to restart (an elastic DEP group re-forming) comes back at once,
    however often, and is never given up on."""
    reports: list[str] = []
    supervisor = Supervisor(RestartPolicy(max_crashes=1, window_s=60, backoff_s=5),
                            reports.append)
    child = supervisor.add("regrouper", lambda: subprocess.Popen(
        [sys.executable, "-c", f"raise SystemExit({EXIT_PLANNED_RESTART})"]))
    deadline = time.monotonic() + 30
    while child.restarts < 3 and time.monotonic() < deadline:
        supervisor.check()  # (would raise GaveUp on the second crash)
        time.sleep(0.02)
    assert child.restarts >= 3 and not child.crashes
    assert "regrouper asked to restart" in reports
    child.proc.wait()


@pytest.fixture(scope="module")
def supervised():
    config = MeshConfig(port=0, engine="mock", num_prefill=1, num_decode=1, num_ep_ranks=0,
                        api_keys=(KEY,), heartbeat_interval_s=0.2, worker_timeout_s=2.0)
    with supervised_mesh(config) as mesh:
        yield mesh


def complete(mesh) -> int:
    try:
        return httpx.post(mesh.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": "tiny-moe", "prompt": "count from 5 : 5 6 7 8 9 10 11 "
                                "12 13 14 15 16 17 18 19 20", "max_tokens": 3},
                          timeout=20).status_code
    except httpx.HTTPError:
        return 0


def by_name(mesh, name: str) -> subprocess.Popen:
    return next(p for p in mesh.procs if p.args[-1] == name)


@pytest.mark.parametrize("name", ["d0", "p0", "kv0"])
def test_a_killed_service_is_restarted_and_the_mesh_serves(supervised, name):
    assert complete(supervised) == 200
    before = by_name(supervised, name)
    before.send_signal(signal.SIGKILL)
    assert wait_for(lambda: by_name(supervised, name).pid != before.pid, timeout=15)
    assert wait_for(lambda: complete(supervised) == 200, timeout=30)


def test_nats_server_comes_back_on_its_port(supervised):
    nats_server = next(s for s in supervised.servers if s.kind == "nats")
    port, pid = nats_server.port, nats_server.proc.pid
    nats_server.proc.send_signal(signal.SIGKILL)
    assert wait_for(lambda: next(s for s in supervised.servers if s.kind == "nats").proc.pid
                    != pid, timeout=15)
    assert next(s for s in supervised.servers if s.kind == "nats").port == port
    assert wait_for(lambda: complete(supervised) == 200, timeout=30)


def test_the_api_key_is_in_no_childs_environment_or_argv(supervised):
    for proc in supervised.procs:
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert KEY.encode() not in environ and KEY.encode() not in cmdline
    key_file = supervised.config.api_key_file
    assert key_file and os.stat(key_file).st_mode & 0o777 == 0o600
