"""`evenflow up --ray` on a Ray cluster over three simulated hosts, as a user builds it: `ray
start --head` on A, `ray start --address` on B and C (token authentication on, one token for
the cluster), NATS and Redis on A. The applications spread over the nodes; a decode DEP group
of 2 ranks asks for 2 nodes (`--ep-nodes 2`) and gets one rank on each, through its placement
group; completions stream the one-host text."""

from __future__ import annotations

import secrets
import sys
import time

import pytest
from mesh_client import health, until_served

from evenflow.dev.hosts import HostProcesses
from evenflow.services.launcher import find_binary

pytestmark = pytest.mark.slow  # three Ray nodes and the mesh's applications: ~2 min

RAY = [sys.executable, "-m", "ray.scripts.scripts"]

def commands(host) -> list[str]:
    """The command lines of the host's processes (Ray names its workers by what they run:
    "ray::ServeReplica:decode:decode")."""
    out = []
    for pid in host.pids():
        try:
            out.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")
                       .decode(errors="replace"))
        except OSError:
            pass
    return out


@pytest.fixture(scope="module")
def ray_mesh(three_hosts, tmp_path_factory):
    pytest.importorskip("ray")
    a, b, c = three_hosts.hosts
    logdir = tmp_path_factory.mktemp("raymesh")
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16),
           "RAY_USAGE_STATS_ENABLED": "0"}
    services = HostProcesses(logdir, {**_environ(), **env})
    start = services.start

    def ray_start(host, *args) -> None:
        done = host.run([*RAY, "start", "--node-ip-address", host.address, "--num-cpus", "2",
                         "--temp-dir", str(logdir / f"ray-{host.index}"), *args],
                        timeout=180, env={**_environ(), **env})
        assert done.returncode == 0, done.stderr[-2000:]

    try:
        start(a, [find_binary("nats-server"), "-a", a.address, "-p", "4222"], "nats")
        start(a, [find_binary("redis-server"), "--bind", a.address, "--port", "6379",
                  "--save", "", "--appendonly", "no", "--dir", str(logdir)], "redis")
        ray_start(a, "--head", "--port", "6380", "--include-dashboard=false")
        ray_start(b, "--address", f"{a.address}:6380")
        ray_start(c, "--address", f"{a.address}:6380")
        start(a, [sys.executable, "-m", "evenflow.cli", "up", "--ray", "--ray-address",
                  f"{a.address}:6380", "--nats-url", f"nats://{a.address}:4222",
                  "--redis-url", f"redis://{a.address}:6379", "--host", a.address, "--port",
                  "8000", "--prefill", "1", "--decode", "1", "--ep", "2", "--ep-nodes", "2"],
              "up")
        yield a, f"http://{a.address}:8000", env
    finally:
        services.stop(grace_s=30)
        # (the Ray nodes' daemons die with their hosts: three_hosts.close kills every
        # process inside a host; `ray stop` would find every Ray on this machine)


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)


def test_the_mesh_on_a_ray_cluster_of_three_hosts(ray_mesh, three_hosts):
    a, url, _ = ray_mesh
    deadline = time.monotonic() + 300
    every_rank = {"prefill": 2, "decode": 2}  # one group each, of two ranks
    while time.monotonic() < deadline and health(a, url).get("workers") != every_rank:
        time.sleep(2)
    assert health(a, url).get("workers") == every_rank, health(a, url)
    assert until_served(a, url, 120).split() == ["7", "8", "9"]
    hosts = three_hosts.hosts
    running = {h.index: commands(h) for h in hosts}
    with_replicas = [i for i, cmds in running.items()
                     if any("ServeReplica:" in c for c in cmds)]
    assert len(with_replicas) >= 2, running  # the applications spread over the nodes
    for role in ("prefill", "decode"):  # each DEP group: rank 0 in its replica, rank 1 away
        (rank0,) = [i for i, cmds in running.items()
                    if any(f"ServeReplica:{role}:{role}" in c for c in cmds)]
        (rank1,) = [i for i, cmds in running.items()
                    if any(f"evenflow.{role} {role[0]}-" in c and c.strip().endswith("r1")
                           for c in cmds)]
        assert rank0 != rank1, running
