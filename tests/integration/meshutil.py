"""Helpers shared by the integration tests."""

from __future__ import annotations

import contextlib
import threading
import time

API_KEY = "test-key"  # the integration mesh requires it


def wait_for(predicate, timeout: float = 8.0, interval: float = 0.05) -> bool:
    """Poll `predicate` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


@contextlib.contextmanager
def running_mesh(config, health_timeout_s: float = 180, env: dict[str, str] | None = None):
    """A LocalMesh started on `config` (with `env` for its services), stopped at the end, also
    when starting it fails."""
    from evenflow.services.launcher import LocalMesh

    mesh = LocalMesh(config)
    try:
        mesh.start(env=env, health_timeout_s=health_timeout_s)
        yield mesh
    finally:
        mesh.stop()


@contextlib.contextmanager
def supervised_mesh(config, backoff_s: float = 0.2, health_timeout_s: float = 180):
    """A LocalMesh started on `config` with a supervision loop in a thread (what `evenflow up`
    does), stopped at the end; fails if the supervisor gave up on a child meanwhile."""
    from evenflow.services.launcher import LocalMesh
    from evenflow.services.supervisor import GaveUp, RestartPolicy

    mesh = LocalMesh(config, restart_policy=RestartPolicy(backoff_s=backoff_s))
    stop = threading.Event()
    problems: list[str] = []

    def loop() -> None:
        while not stop.is_set():
            try:
                mesh.supervise(report=lambda m: None)
            except GaveUp as exc:
                problems.append(str(exc))
                return
            time.sleep(0.1)

    try:
        mesh.start(health_timeout_s=health_timeout_s)
        threading.Thread(target=loop, daemon=True).start()
        yield mesh
        assert not problems
    finally:
        stop.set()
        mesh.stop()
