"""The simulated hosts are hosts: their own addresses, reachable over their link only, their
own /dev/shm; and nothing they ran or made outlives them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from evenflow.dev.hosts import SimCluster, probe


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_hosts_talk_over_their_link_and_share_no_memory(three_hosts):
    a, b, _ = three_hosts.hosts
    server = b.popen([sys.executable, "-c",
                      "import socket; s = socket.socket(); "
                      f"s.bind(('{b.address}', 9100)); s.listen(); c, _ = s.accept(); "
                      "c.sendall(b'from b')"])
    try:
        reply = ""
        for _ in range(50):  # until b listens
            got = a.run([sys.executable, "-c",
                         "import socket; print(socket.create_connection("
                         f"('{b.address}', 9100), timeout=2).recv(16).decode())"])
            if got.returncode == 0:
                reply = got.stdout.strip()
                break
            time.sleep(0.1)
        assert reply == "from b"
    finally:
        server.kill()
        server.wait()
    name = f"evenflow-probe-{os.getpid()}"
    assert a.run(["sh", "-c", f"echo x > /dev/shm/{name}"]).returncode == 0
    assert name in a.run(["ls", "/dev/shm"]).stdout
    assert name not in b.run(["ls", "/dev/shm"]).stdout  # another host's shared memory
    assert not os.path.exists(f"/dev/shm/{name}")  # nor the machine's


def test_a_link_taken_down_cuts_the_host_off(three_hosts):
    a, b, _ = three_hosts.hosts
    connect = [sys.executable, "-c", "import socket, sys\ntry:\n"
               f"    socket.create_connection(('{b.address}', 9) , timeout=1)\n"
               "except ConnectionRefusedError: sys.exit(0)\nexcept OSError: sys.exit(1)"]
    assert a.run(connect).returncode == 0  # refused: b answered
    three_hosts.set_link(b, up=False)
    try:
        assert a.run(connect).returncode == 1  # no answer at all
    finally:
        three_hosts.set_link(b, up=True)


def test_close_removes_every_namespace_and_process():
    why = probe()
    if why is not None:
        pytest.skip(f"simulated hosts unavailable here: {why}")
    cluster = SimCluster.create(2)
    sleeper = cluster.hosts[1].popen(["sleep", "300"])
    names = {h.name for h in cluster.hosts} | {cluster.switch}
    assert names <= netns_names()
    cluster.close()
    assert not names & netns_names()
    assert sleeper.wait(5) == -9
