"""`evenflow bus-secrets` (the deploy/ configuration): a nats-server started with the written
config refuses anonymous clients and keeps the roles apart; the files are private."""

from __future__ import annotations

import asyncio
import os
import stat

import nats
import pytest

from evenflow.cli import main as cli
from evenflow.proto import subjects
from evenflow.services.launcher import free_port, start_nats
from evenflow.services.nats_auth import read_credentials


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    directory = tmp_path_factory.mktemp("secrets") / "bus"
    port = free_port()
    assert cli(["bus-secrets", str(directory), "--port", str(port), "--host", "127.0.0.1"]) == 0
    server = start_nats(port, str(directory / "nats-server.conf"))
    yield server, directory
    server.stop()


def publish_as(server, directory, role: str, subject: str) -> tuple[bool, list[str]]:
    errors: list[str] = []

    async def scenario() -> bool:
        admin_user, admin_password = read_credentials(str(directory / "nats-admin.creds"))
        watcher = await nats.connect(server.url, user=admin_user, password=admin_password)
        sub = await watcher.subscribe(subject)
        user, password = read_credentials(str(directory / f"nats-{role}.creds"))

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        sender = await nats.connect(server.url, user=user, password=password, error_cb=on_error,
                                    allow_reconnect=False)
        await sender.publish(subject, b"x")
        await sender.flush()
        try:
            await sub.next_msg(timeout=0.5)
            delivered = True
        except nats.errors.TimeoutError:
            delivered = False
        await asyncio.sleep(0.2)
        await sender.close()
        await watcher.close()
        return delivered

    return asyncio.run(scenario()), errors


def test_files_are_private(secured):
    _, directory = secured
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for path in directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


def test_anonymous_clients_are_refused(secured):
    server, _ = secured

    async def attempt() -> None:
        await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0,
                           connect_timeout=3)

    with pytest.raises(Exception, match="(?i)authorization|no servers"):
        asyncio.run(attempt())


@pytest.mark.parametrize(("role", "subject", "allowed"), [
    ("gateway", subjects.EXPERT_PLACEMENT, False),
    ("decode", subjects.prefill_worker("p-any"), False),
    ("prefill", subjects.decode_worker("d-any"), False),
    ("balancer", subjects.EXPERT_PLACEMENT, True),
    ("gateway", subjects.decode_worker("d-any"), True),
    ("decode", subjects.heartbeat("decode", "d-any"), True),
    ("decode", subjects.heartbeat("gateway", "g"), False),
])
def test_each_role_publishes_only_its_part(secured, role, subject, allowed):
    server, directory = secured
    delivered, errors = publish_as(server, directory, role, subject)
    assert delivered == allowed
    if not allowed:
        assert any("permissions violation" in e.lower() for e in errors)


def test_evenflow_up_ray_starts_a_secured_nats_and_hands_each_role_its_file():
    from evenflow.rayserve.local import LocalRayMesh
    from evenflow.services.config import MeshConfig

    mesh = LocalRayMesh(MeshConfig())
    try:
        cfg = mesh._start_secure_nats(mesh.config)
        # (planner: the SLA planner's; engine: a worker that may switch role holds both
        # engine roles' permissions)
        assert set(mesh.credentials) == {"gateway", "prefill", "decode", "kv_index", "balancer",
                                         "planner", "engine", "admin"}
        for path in mesh.credentials.values():
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600

        async def attempt(**kwargs):
            nc = await nats.connect(cfg.nats_url, allow_reconnect=False,
                                    max_reconnect_attempts=0, connect_timeout=3, **kwargs)
            await nc.close()

        with pytest.raises(Exception, match="(?i)authorization|no servers"):
            asyncio.run(attempt())
        user, password = read_credentials(mesh.credentials["decode"])
        asyncio.run(attempt(user=user, password=password))
    finally:
        secrets_dir = mesh._secrets
        for server in mesh.servers:
            server.stop()
        mesh.servers.clear()
        if secrets_dir:
            import shutil

            shutil.rmtree(secrets_dir, ignore_errors=True)


def test_up_with_a_wrong_nats_password_says_so_and_exits_clean(secured, tmp_path):
    """A service NATS refuses says so once and exits; `up` stops what it started (its Redis
    included) and removes its temporary files, without a signal from anyone."""
    import subprocess
    import sys

    server, _ = secured
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    proc = subprocess.run(
        [sys.executable, "-m", "evenflow.cli", "up", "--port", "0",
         "--nats-url", f"nats://nobody:wrong@127.0.0.1:{server.port}"],
        capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0
    assert "NATS refused" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not list(scratch.glob("evenflow-*"))
