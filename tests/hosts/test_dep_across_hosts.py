"""A DEP group spanning two simulated hosts, deployed as a user would: ranks 0 and 1 on A
(with the gateway, the KV index, NATS, Redis and the group's rendezvous store), ranks 2 and 3
on B, started by `evenflow serve --ep 4 --ep-ranks ... --ep-rendezvous A:PORT`. The MoE
all-to-alls go through shared memory on each host and gloo between them. Its completions
equal the one-host engine's token for token; with B's processes killed, A's ranks re-form a
group of two and serve within seconds (a stream in flight migrates with its text unchanged);
B back, the group takes its ranks again."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest
from mesh_client import complete, health, until_served

from evenflow.dev.hosts import HostProcesses
from evenflow.engine.api.llm import LLM, SamplingParams
from evenflow.services.launcher import find_binary

pytestmark = pytest.mark.slow  # 4 rank processes on 2 hosts: ~60 s

PROMPT, MAX_TOKENS = "count from 3 :", 12
LONG_TOKENS = 40  # a stream in flight when host B dies (steps slowed to 40 ms: ~2 s long)
RENDEZVOUS_PORT = 29400


@pytest.fixture(scope="module")
def expected() -> dict[int, str]:
    """The one-host engine's greedy texts (no expert parallelism), float32 as the mesh, by
    max_tokens."""
    llm = LLM("tiny-moe", dtype="float32")
    return {n: llm.generate([PROMPT], SamplingParams(max_tokens=n, temperature=0))[0].text
            for n in (MAX_TOKENS, LONG_TOKENS)}


class Deployment(HostProcesses):
    """The group's deployment on hosts A and B (services logged per name in logdir)."""

    def __init__(self, hosts, logdir) -> None:
        # steps slowed to 40 ms: a 40-token stream is in flight long enough to kill B under it
        super().__init__(logdir, {**os.environ, "EVENFLOW_DEBUG_STEP_DELAY_MS": "40"})
        self.a, self.b = hosts.hosts[0], hosts.hosts[1]
        self.url = f"http://{self.a.address}:8000"
        a = self.a.address
        self.common = ["--nats-url", f"nats://{a}:4222", "--redis-url", f"redis://{a}:6379",
                       "--model", "tiny-moe", "--dtype", "float32", "--prefill", "0",
                       "--ep", "4", "--ep-rendezvous", f"{a}:{RENDEZVOUS_PORT}"]

    def serve(self, host, name, *args) -> subprocess.Popen:
        return self.start(host, [sys.executable, "-m", "evenflow.cli", "serve", *self.common,
                                 *args], name)

    def group_sizes(self) -> list[tuple[int, int]]:
        """(epoch, members) of every epoch a rank joined, from the hosts' logs."""
        text = self.log("host-a") + self.log("host-b")
        return sorted({(int(e), int(n)) for e, n in re.findall(
            r"epoch (\d+): rank \d+ of (\d+)", text)})


@pytest.fixture(scope="module")
def dep2(three_hosts, tmp_path_factory):
    d = Deployment(three_hosts, tmp_path_factory.mktemp("dep2"))
    a = d.a
    try:
        d.start(a, [find_binary("nats-server"), "-a", a.address, "-p", "4222"], "nats")
        d.start(a, [find_binary("redis-server"), "--bind", a.address, "--port", "6379",
                    "--save", "", "--appendonly", "no", "--dir", str(d.logdir)], "redis")
        d.serve(a, "host-a", "--roles", "gateway,kv_index,decode", "--host", a.address,
                "--port", "8000", "--ep-ranks", "0,1", "--ep-rendezvous-serve")
        d.serve(d.b, "host-b", "--roles", "decode", "--ep-ranks", "2,3")
        yield d
    finally:
        d.stop()


def until_decode_workers(d: Deployment, count: int, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if health(d.a, d.url).get("workers", {}).get("decode") == count:
            return
        time.sleep(0.5)
    raise AssertionError(f"not {count} decode workers within {within_s} s: "
                         f"{health(d.a, d.url)}; epochs {d.group_sizes()}")


def test_a_group_over_two_hosts_matches_one_host(dep2, expected):
    until_decode_workers(dep2, 4, 180)
    assert (0, 4) in dep2.group_sizes()  # one epoch, every rank in it
    for _ in range(3):  # each rank takes requests of its own (data-parallel attention)
        text = until_served(dep2.a, dep2.url, 60, prompt=PROMPT, max_tokens=MAX_TOKENS)
        assert text == expected[MAX_TOKENS]


def test_the_survivors_serve_and_take_the_lost_host_back(dep2, three_hosts, expected):
    until_decode_workers(dep2, 4, 180)
    in_flight: list = []  # a stream running when B dies: it migrates, its text unchanged
    stream = threading.Thread(target=lambda: in_flight.append(complete(
        dep2.a, dep2.url, timeout_s=120, prompt=PROMPT, max_tokens=LONG_TOKENS)))
    stream.start()
    time.sleep(1.0)
    three_hosts.kill_processes(dep2.b)  # host B's serve and both its ranks, SIGKILL
    killed = time.monotonic()
    until_served(dep2.a, dep2.url, 30, poll_s=0.1, prompt=PROMPT, max_tokens=MAX_TOKENS)
    took = time.monotonic() - killed
    # A's ranks alone, as a group of two. On a loaded machine one of them may register first
    # and form an epoch of one, which serves; the other then asks to join and the group
    # re-forms with both (bounded: it must come)
    deadline = time.monotonic() + 30
    while not any(n == 2 for _, n in dep2.group_sizes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    sizes = dep2.group_sizes()
    assert any(n == 2 for _, n in sizes), sizes
    # bounded, not timed: ~6 s on an idle 2-vCPU machine, ~10 s with it busy with another
    # test run (speed targets are for benchmarks; a test asserts no hang)
    print(f"served again {took:.1f} s after host B's ranks died")
    assert took < 30, f"served again only {took:.1f} s after host B's ranks died"
    assert complete(dep2.a, dep2.url, prompt=PROMPT, max_tokens=MAX_TOKENS) == (
        200, expected[MAX_TOKENS])
    stream.join(130)
    assert in_flight == [(200, expected[LONG_TOKENS])]
    # B comes back: its ranks ask to join, the group re-forms with all four
    dep2.serve(dep2.b, "host-b", "--roles", "decode", "--ep-ranks", "2,3")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and dep2.group_sizes()[-1][1] != 4:
        time.sleep(0.5)
    assert dep2.group_sizes()[-1][1] == 4, dep2.group_sizes()
    until_decode_workers(dep2, 4, 60)
    for _ in range(3):
        assert until_served(dep2.a, dep2.url, 60, prompt=PROMPT,
                            max_tokens=MAX_TOKENS) == expected[MAX_TOKENS]
