"""`evenflow bench soak --minutes M`: mixed load against a supervised local mesh (as
`evenflow up` runs it) while a fault injector kills or stops random workers and restarts
nats-server and redis-server. Reports requests by outcome and cause, p99 TTFT per window, the
RSS of every process over time (a table and a PNG), and the KV blocks still held at the end.

The load: streamed greedy completions of a fixed prompt set (their fault-free text is taken
first, so a stream that survived a fault can be compared with it), long prompts, clients that
disconnect mid-stream, and bad requests (which must get a 4xx). A stream counts as lost when
it ends without `data: [DONE]`: a fault may fail a request, never silently.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import httpx
import orjson

from evenflow.bench.machine import machine_line

PROMPTS = [f"count from {n} :" for n in (5, 40, 117, 230, 301, 402)] + [
    "reverse : a b c d e f =", "count down from 90 :"]
LONG = "count from 1 : " + " ".join(str(i) for i in range(1, 120))
BAD: list[dict[str, object]] = [{"temperature": "hot"}, {"max_tokens": 0}, {"top_k": 2**63},
                                {"stop_token_ids": [-1]}, {"n": 3}]


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # "ok", "error:<code>", "lost", ...
    ttfts: list[tuple[float, float]] = field(default_factory=list)  # (t, seconds)
    mismatches: int = 0
    mismatched: list[tuple[str, str, str]] = field(default_factory=list)  # prompt, want, got
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, ttft: tuple[float, float] | None = None) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if ttft is not None:
                self.ttfts.append(ttft)


class Streamed(NamedTuple):
    outcome: str
    text: str
    ttft: float  # seconds
    request_id: str = ""  # the gateway's id (its logs name retries by it)


def stream(client: httpx.Client, body: dict, disconnect_after: int = 0) -> Streamed:
    """One streamed completion."""
    started = time.monotonic()
    text, ttft, request_id = "", 0.0, ""
    try:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True},
                           timeout=60) as resp:
            if resp.status_code != 200:
                resp.read()
                return Streamed(f"http:{resp.status_code}", "", 0.0)
            events = 0
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    outcome = "ok" if not text.startswith("\0") else "error"
                    return Streamed(outcome, text, ttft, request_id)
                event = orjson.loads(data)
                request_id = event.get("id", request_id)
                if "error" in event:
                    text = "\0" + str(event["error"].get("code"))
                    continue
                if not ttft:
                    ttft = time.monotonic() - started
                text += event["choices"][0]["text"]
                events += 1
                if disconnect_after and events >= disconnect_after:
                    return Streamed("disconnected", text, ttft, request_id)
    except httpx.HTTPError as exc:
        return Streamed(f"transport:{type(exc).__name__}", "", 0.0)
    return Streamed("lost", text, ttft, request_id)


def client_loop(url: str, references: dict[str, str], tally: Tally, stop: threading.Event,
                seed: int, t0: float) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url) as client:
        while not stop.is_set():
            kind, text = rng.random(), ""
            if kind < 0.6:
                prompt = rng.choice(PROMPTS)
                body = {"model": "tiny-moe", "prompt": prompt, "max_tokens": 24,
                        "temperature": 0}
                outcome, text, ttft, request_id = stream(client, body)
                if outcome == "ok" and text != references[prompt]:
                    with tally.lock:
                        tally.mismatches += 1
                        tally.mismatched.append((prompt, references[prompt],
                                                 f"{text} [{request_id}]"))
            elif kind < 0.75:
                outcome, text, ttft, _ = stream(client, {"model": "tiny-moe", "prompt": LONG,
                                                   "max_tokens": 8, "temperature": 0})
            elif kind < 0.85:
                outcome, _, ttft, _ = stream(client, {"model": "tiny-moe", "prompt": PROMPTS[0],
                                                   "max_tokens": 200, "ignore_eos": True},
                                          disconnect_after=3)
            else:
                body = {"model": "tiny-moe", "prompt": PROMPTS[1], **rng.choice(BAD)}
                status = client.post("/v1/completions", json=body, timeout=30).status_code
                outcome, ttft = ("rejected_4xx" if 400 <= status < 500 else f"bad:{status}"), 0
            if outcome.startswith("error"):
                outcome = "error:" + (text[1:] if text.startswith("\0") else "?")
            tally.add(outcome, (time.monotonic() - t0, ttft) if ttft else None)


def inject_faults(mesh, every_s: float, stop: threading.Event, log: list[str],
                  seed: int, t0: float) -> None:
    rng = random.Random(seed)
    while not stop.wait(every_s):
        workers = [p for p in mesh.procs if str(p.args[-1])[:1] in "pd" and p.poll() is None]
        fault = rng.choice(["kill", "stop", "nats", "redis"])
        at = f"{time.monotonic() - t0:6.1f}s"
        if fault in ("kill", "stop") and workers:
            victim = rng.choice(workers)
            if fault == "kill":
                victim.send_signal(signal.SIGKILL)
                log.append(f"{at} kill -9 {victim.args[-1]}")
            else:
                victim.send_signal(signal.SIGSTOP)
                log.append(f"{at} SIGSTOP {victim.args[-1]} for 5 s")
                stop.wait(5)
                victim.send_signal(signal.SIGCONT)
        else:
            server = next((s for s in mesh.servers if s.kind == fault), None)
            if server is not None:
                server.proc.send_signal(signal.SIGKILL)
                log.append(f"{at} kill -9 {fault}-server (restarted on its port)")


def sample_rss(mesh, stop: threading.Event,
               samples: dict[str, list[tuple[float, float, int]]], t0: float) -> None:
    import psutil

    while not stop.wait(5.0):
        procs = [(str(p.args[-1]) if "-m" in p.args else "x", p.pid) for p in mesh.procs]
        procs += [(f"{s.kind}-server", s.proc.pid) for s in mesh.servers]
        for name, pid in procs:
            try:
                rss = psutil.Process(pid).memory_info().rss / 2**20
            except psutil.Error:
                continue
            if rss == 0:  # killed, not yet reaped
                continue
            samples.setdefault(name, []).append((time.monotonic() - t0, rss, pid))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="evenflow bench soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--fault-every", type=float, default=30.0, help="seconds between faults")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--out", default="soak-out", help="directory for the RSS PNG")
    args = parser.parse_args(argv)

    from evenflow.services.config import MeshConfig
    from evenflow.services.launcher import LocalMesh
    from evenflow.services.supervisor import GaveUp

    print(machine_line(dtype="engine default (auto)", threads=1))
    config = MeshConfig(port=0, num_prefill=args.prefill, num_decode=args.decode,
                        local_prefill_threshold=16, heartbeat_interval_s=0.25,
                        worker_timeout_s=2.0)
    mesh = LocalMesh(config)
    mesh.start(health_timeout_s=300)
    stop, supervising = threading.Event(), threading.Event()
    gave_up: list[str] = []

    def supervise() -> None:
        while not supervising.is_set():
            try:
                mesh.supervise(report=lambda m: None)
            except GaveUp as exc:
                gave_up.append(str(exc))
                return
            time.sleep(0.2)

    threads = [threading.Thread(target=supervise, daemon=True)]
    threads[0].start()
    try:
        with httpx.Client(base_url=mesh.url) as client:
            references = {p: stream(client, {"model": "tiny-moe", "prompt": p, "max_tokens": 24,
                                             "temperature": 0}).text for p in PROMPTS}
        tally, faults = Tally(), list[str]()
        rss: dict[str, list[tuple[float, float, int]]] = {}
        t0 = time.monotonic()
        workers = [threading.Thread(target=client_loop, args=(mesh.url, references, tally,
                                                              stop, i, t0), daemon=True)
                   for i in range(args.clients)]
        workers.append(threading.Thread(target=inject_faults, daemon=True, args=(
            mesh, args.fault_every, stop, faults, 7, t0)))
        workers.append(threading.Thread(target=sample_rss, args=(mesh, stop, rss, t0),
                                        daemon=True))
        for w in workers:
            w.start()
        time.sleep(args.minutes * 60)
        stop.set()
        for w in workers:
            w.join(90)
        time.sleep(5)  # let aborted and migrated requests settle
        held = kv_blocks_held(mesh)
        retries = retries_by_cause(mesh.url)
        report(tally, faults, rss, held, gave_up, args)
        print("requests the gateway re-sent elsewhere (retried or migrated), by cause: "
              + (", ".join(f"{code} {n:g}" for code, n in retries.items()) or "none"))
    finally:
        supervising.set()
        mesh.stop()
    return 0


def retries_by_cause(url: str) -> dict[str, float]:
    """The gateway's evenflow_request_retries_total, by error code."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^evenflow_request_retries_total\{code="([^"]+)"\} (\S+)$', text, re.M)}


def kv_blocks_held(mesh) -> dict[str, int]:
    """worker -> KV blocks in use (total - free) from its latest heartbeat."""
    import asyncio

    import nats

    from evenflow.proto import subjects
    from evenflow.proto.messages import WorkerHeartbeat, decode

    async def read() -> dict[str, int]:
        nc = await nats.connect(mesh.admin_nats_url or mesh.config.nats_url)
        held: dict[str, int] = {}
        sub = await nc.subscribe(subjects.HEARTBEATS)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            try:
                msg = decode((await sub.next_msg(timeout=1)).data)
            except Exception:
                continue
            if isinstance(msg, WorkerHeartbeat) and msg.total_kv_blocks:
                held[msg.worker_id] = msg.total_kv_blocks - msg.free_kv_blocks
        await nc.close()
        return held

    return asyncio.run(read())


WARM_UP_S = 30.0
LONG_LIFE_S = 180.0


def incarnations(points: list[tuple[float, float, int]]) -> list[tuple[int, list]]:
    """Split one process name's samples by pid, in order: each restart starts a new life."""
    lives: list[tuple[int, list]] = []
    for point in points:
        if not lives or lives[-1][0] != point[2]:
            lives.append((point[2], []))
        lives[-1][1].append(point)
    return lives


def report(tally: Tally, faults: list[str], rss: dict[str, list[tuple[float, float, int]]],
           held: dict[str, int], gave_up: list[str], args: argparse.Namespace) -> None:
    from evenflow.bench.png import line_chart

    print(f"\nsoak: {args.minutes:g} min, {args.prefill} prefill + {args.decode} decode, "
          f"{args.clients} clients, a fault every {args.fault_every:g} s")
    print("faults injected:")
    for line in faults:
        print("  " + line)
    total = sum(tally.outcomes.values())
    print(f"\nrequests: {total}")
    for outcome, n in tally.outcomes.most_common():
        print(f"  {outcome:<28}{n:>7}")
    lost = sum(n for o, n in tally.outcomes.items() if o in ("lost",) or o.startswith("transport"))
    print(f"lost without an error event: {lost}")
    print(f"completed greedy streams differing from their fault-free text: {tally.mismatches}")
    for prompt, want, got in tally.mismatched[:5]:
        print(f"  {prompt!r}\n    fault-free: {want!r}\n    this run:   {got!r}")
    print("\np99 TTFT per 30 s window:")
    windows: dict[int, list[float]] = {}
    for t, ttft in tally.ttfts:
        windows.setdefault(int(t // 30), []).append(ttft)
    for w, values in sorted(windows.items()):
        p99 = statistics.quantiles(values, n=100)[98] if len(values) > 1 else values[0]
        print(f"  {w * 30:>5}-{w * 30 + 30:<5}s  n={len(values):<5} p99 {p99 * 1e3:8.1f} ms")
    print("\nRSS (MiB) per process incarnation (a restart is a new pid): first sample after "
          "warm-up, last, growth")
    worst: list[float] = []
    for name, points in sorted(rss.items()):
        for pid, life in incarnations(points):
            span = life[-1][0] - life[0][0]
            warm = life[0][0] + max(WARM_UP_S, 0.2 * span)
            settled = [p for p in life if p[0] >= warm] or life
            first, last = settled[0][1], settled[-1][1]
            growth = (last / first - 1) * 100
            if span >= LONG_LIFE_S:
                worst.append(growth)
            print(f"  {name:<16}pid {pid:<8}{span:>6.0f} s"
                  f"{first:>9.1f}{last:>9.1f}{growth:>+8.1f}%")
    if worst:
        print(f"  largest growth of an incarnation that lived >= {LONG_LIFE_S:.0f} s: "
              f"{max(worst):+.1f}%")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "rss.png")
    line_chart(path, [[(t, r) for t, r, _ in points] for _, points in sorted(rss.items())])
    print(f"  (chart: {path}; one line per process, in the order above)")
    print(f"\nKV blocks still held at the end: {sum(held.values())} {held}")
    if gave_up:
        print(f"supervisor gave up: {gave_up}")
