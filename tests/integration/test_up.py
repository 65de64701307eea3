"""`evenflow up`: serves on the printed URL, and Ctrl-C leaves no process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest


def children_of(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return {int(x) for x in out.stdout.split()}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().split()[2] != "Z"


@pytest.mark.slow
def test_up_serves_and_ctrl_c_stops_everything(tmp_path):
    """... with an engine switch set in its environment, which the workers honour (their
    ready line says which kernels they run), and a temporary KV disk tier per worker, removed
    with everything else `up` made in the temp directory."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = {**os.environ, "EVENFLOW_NATIVE_PREFILL_ATTENTION": "0", "TMPDIR": str(scratch)}
    log = (tmp_path / "stderr").open("w+")
    # in a session of its own, as a terminal runs it: Ctrl-C goes to the whole group
    proc = subprocess.Popen([sys.executable, "-m", "evenflow.cli", "up", "--port", "0",
                             "--kv-disk-gb", "0.01"],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                            start_new_session=True)
    stopping_at = 0
    try:
        url = None
        deadline = time.monotonic() + 180
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if match := re.search(r"at (http://\S+)", line):
                url = match.group(1)
        assert url, "evenflow up printed no URL"
        health = httpx.get(url + "/health")  # printed once every worker started is live
        assert health.status_code == 200
        assert health.json() == {"status": "ok", "workers": {"prefill": 1, "decode": 1}}
        out = httpx.post(url + "/v1/completions", json={
            "model": "tiny-moe", "prompt": "count from 7 :", "max_tokens": 3, "temperature": 0})
        assert out.json()["choices"][0]["text"].split() == ["7", "8", "9"]
        kids = children_of(proc.pid)
        assert len(kids) == 7  # nats, redis, gateway, prefill, decode, kv_index, balancer
        log.seek(0)
        ready = [line for line in log if " ready (" in line]
        assert len(ready) == 2, ready  # the prefill and the decode worker
        for line in ready:
            assert "prefill_attention (EVENFLOW_NATIVE_PREFILL_ATTENTION=0)" in line, line
            assert "weights bf16; KV cache bf16;" in line, line
        card = httpx.get(url + "/v1/models").json()["data"][0]
        assert card["id"] == "tiny-moe" and card["max_model_len"] > 0
        assert [(w["id"], w["weights"], w["kv_cache_dtype"]) for w in card["workers"]] == [
            ("d0", "bf16", "bf16"), ("p0", "bf16", "bf16")]
        assert all("linear" in w["kernels"] for w in card["workers"])
        tiers = {p.parent.name for p in scratch.glob("evenflow-kv-disk-*/*/pool.bin")}
        assert tiers == {"p0", "d0"}
        log.seek(0, 2)
        stopping_at = log.tell()
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: every process of the group
        proc.wait(30)
    log.seek(stopping_at)
    after = log.read().splitlines()
    log.close()
    # the services stop in order (each in a session of its own, so the signal reaches `up`
    # alone), workers before NATS: nobody warns that NATS went away
    assert not [line for line in after if "WARNING" in line or "Traceback" in line], after
    assert re.fullmatch(r"evenflow up: stopped 7 services in \d+\.\d s", after[-1]), after
    time.sleep(0.5)
    assert not [pid for pid in kids if alive(pid)]
    # disk tiers, NATS and Redis directories, secrets: all gone (torch's own caches may stay)
    assert not list(scratch.glob("evenflow-*"))


def test_up_says_what_is_wrong_in_one_line():
    import socket

    def up(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "evenflow.cli", "up", *args],
                              capture_output=True, text=True, timeout=60)

    bad_model = up("--model", "/nonexistent")
    assert bad_model.returncode == 2 and "Traceback" not in bad_model.stderr
    assert bad_model.stderr.strip().count("\n") == 0 and "/nonexistent" in bad_model.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        in_use = up("--port", str(taken.getsockname()[1]))
    assert in_use.returncode == 2 and "Traceback" not in in_use.stderr
    assert "in use" in in_use.stderr and in_use.stderr.strip().count("\n") == 0


def test_a_port_left_in_time_wait_does_not_stop_up():
    """A previous mesh's connections linger in TIME_WAIT on its port; `up`'s check binds as
    the servers do (SO_REUSEADDR) and lets it start."""
    import socket

    from evenflow.cli import _preflight
    from evenflow.services.config import MeshConfig

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the server side closes first: its end of the port goes to TIME_WAIT
    client.close()
    listener.close()
    with socket.socket() as plain:  # what the check did before: refused
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
    assert _preflight(MeshConfig(port=port)) is None


@pytest.mark.slow
def test_killing_up_outright_takes_its_services_with_it():
    """The services run in sessions of their own (a terminal's Ctrl-C reaches `up` alone), yet
    `up` killed with SIGKILL leaves none of them running: each dies with its parent."""
    proc = subprocess.Popen([sys.executable, "-m", "evenflow.cli", "up", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    kids: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if "evenflow is serving" in proc.stdout.readline():
                break
        kids = children_of(proc.pid)
        assert len(kids) == 7
    finally:
        proc.kill()
        proc.wait(30)
    deadline = time.monotonic() + 15
    while [pid for pid in kids if alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in kids if alive(pid)]
