"""`evenflow bench chaos --minutes 30`: the mesh over three simulated hosts (evenflow/dev/hosts.py)
under steady mixed load while a fault comes every 30-90 s, and what it cost.

The mesh, as a user deploys it with `evenflow serve` (deterministic, float32, tiny-moe): a NATS
cluster (a server per host, routes between them), Redis, the gateway and the KV index on A;
prefill p1 and decode d1 on B, p2 and d2 on C; and decode d5, a DEP group of two ranks, rank 0
on B and rank 1 on C (its rendezvous store on B). Each host's `serve` restarts what dies, and
each lists its own NATS server first.

The load (run on host A, the only place the gateway's address is reachable): clients sending
streamed greedy completions of a fixed prompt set (their fault-free text is taken first),
non-streamed ones, long prompts, and streams the client drops after a few tokens.

The faults, one at random each time: kill -9 a prefill or decode worker; kill -9 a DEP rank;
kill -9 a NATS node (started again after 3 s); take host B's or C's link down for 5 s;
SIGSTOP a worker for 3 s; kill Redis and start it again.

Reported: requests by outcome (lost: a stream that ended without `[DONE]`, or a client that
got no answer; errors: clean error answers), whether every stream the gateway moved to
another worker after some of its tokens (its log says so) has the fault-free text, the p99
of the longest gap between two chunks of the streams running in the 15 s after each fault,
each service's RSS growth after its first 5 minutes, and how long each killed process took to
be back (a new process, alive for a second). The last line:
`chaos: N requests, lost L, errors E, migrated identical M/K, rss growth max G%, recovery max S s`.
Needs root (network namespaces), iproute2 and nsenter.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PROMPTS = [f"count from {n} :" for n in (5, 40, 117, 230, 301, 402)] + [
    "reverse : a b c d e f =", "count down from 90 :"]
LONG = "count from 1 : " + " ".join(str(i) for i in range(1, 120))
RENDEZVOUS_PORT = 29500
WORKERS = {"p1": "B", "d1": "B", "p2": "C", "d2": "C"}
DEP_RANKS = {"d5r0": "B", "d5r1": "C"}
FAULTS = ("kill_worker", "kill_dep_rank", "kill_nats", "link_down", "sigstop", "restart_redis")


# -- the load (a process on host A) -----------------------------------------------------------
def _stream(client, body: dict, drop_after: int = 0) -> dict:
    """One streamed completion: outcome, the gateway's id, text, and its longest gap."""
    import httpx
    import orjson

    started = last = time.time()
    text, request_id, gap, gap_at = "", "", 0.0, started
    try:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True},
                           timeout=120) as resp:
            if resp.status_code != 200:
                resp.read()
                return {"outcome": f"http_{resp.status_code}", "t0": started, "t1": time.time()}
            events = 0
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                now = time.time()
                if now - last > gap:
                    gap, gap_at = now - last, last
                last = now
                if data == "[DONE]":
                    error = text.startswith("\0")
                    return {"outcome": "error" + text[1:] if error else "ok", "id": request_id,
                            "text": "" if error else text, "t0": started, "t1": now,
                            "gap": gap, "gap_at": gap_at}
                event = orjson.loads(data)
                request_id = event.get("id", request_id)
                if "error" in event:
                    text = "\0:" + str(event["error"].get("code"))
                    continue
                if event.get("choices"):
                    text += event["choices"][0]["text"]
                events += 1
                if drop_after and events >= drop_after:
                    return {"outcome": "dropped_by_client", "t0": started, "t1": now}
    except httpx.HTTPError as exc:
        return {"outcome": f"lost_{type(exc).__name__}", "t0": started, "t1": time.time()}
    return {"outcome": "lost_no_done", "t0": started, "t1": time.time(), "text": text}


def load_main(url: str, seconds: float, out: str, clients: int, seed: int) -> int:
    import httpx

    results = open(out, "a")
    lock = threading.Lock()
    references: dict[str, str] = {}
    with httpx.Client(base_url=url) as client:
        for prompt in PROMPTS:  # fault-free texts, before any fault
            body = {"model": "tiny-moe", "prompt": prompt, "max_tokens": 24, "temperature": 0}
            for _ in range(30):
                got = _stream(client, body)
                if got["outcome"] == "ok":
                    references[prompt] = got["text"]
                    break
                time.sleep(2)
    Path(out + ".ready").write_text(json.dumps(references))
    deadline = time.time() + seconds

    def client_loop(index: int) -> None:
        rng = random.Random(seed + index)
        with httpx.Client(base_url=url) as client:
            while time.time() < deadline:
                kind = rng.random()
                if kind < 0.55:
                    prompt = rng.choice(PROMPTS)
                    row = _stream(client, {"model": "tiny-moe", "prompt": prompt,
                                           "max_tokens": 24, "temperature": 0})
                    row |= {"kind": "stream", "prompt": prompt,
                            "reference": references.get(prompt)}
                elif kind < 0.7:
                    started = time.time()
                    try:
                        resp = client.post("/v1/completions", timeout=120, json={
                            "model": "tiny-moe", "prompt": rng.choice(PROMPTS),
                            "max_tokens": 16, "temperature": 0})
                        outcome = "ok" if resp.status_code == 200 else f"http_{resp.status_code}"
                    except httpx.HTTPError as exc:
                        outcome = f"lost_{type(exc).__name__}"
                    row = {"kind": "whole", "outcome": outcome, "t0": started,
                           "t1": time.time()}
                elif kind < 0.85:
                    row = _stream(client, {"model": "tiny-moe", "prompt": LONG,
                                           "max_tokens": 8, "temperature": 0})
                    row["kind"] = "long"
                else:
                    row = _stream(client, {"model": "tiny-moe", "prompt": PROMPTS[0],
                                           "max_tokens": 200, "ignore_eos": True},
                                  drop_after=3)
                    row["kind"] = "cancel"
                with lock:
                    results.write(json.dumps(row) + "\n")
                    results.flush()

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.close()
    return 0


# -- the orchestrator (the machine's own namespace) ---------------------------------------------
def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Chaos:
    def __init__(self, cluster, logdir: Path, seed: int) -> None:
        from evenflow.dev.hosts import HostProcesses

        self.cluster, self.logdir = cluster, logdir
        self.hosts = dict(zip("ABC", cluster.hosts, strict=True))
        self.procs = HostProcesses(logdir)
        self.rng = random.Random(seed)
        self.nats: dict[str, subprocess.Popen] = {}
        self.redis: subprocess.Popen | None = None
        self.faults: list[dict] = []
        self.rss: dict[tuple[str, int], list[tuple[float, float]]] = {}

    # the deployment
    def nats_argv(self, name: str) -> list[str]:
        from evenflow.services.launcher import find_binary

        host = self.hosts[name]
        routes = ",".join(f"nats://{h.address}:6222" for n, h in self.hosts.items() if n != name)
        return [find_binary("nats-server"), "-a", host.address, "-p", "4222", "--cluster_name",
                "evenflow", "--cluster", f"nats://{host.address}:6222", "--routes", routes]

    def redis_argv(self) -> list[str]:
        from evenflow.services.launcher import find_binary

        return [find_binary("redis-server"), "--bind", self.hosts["A"].address, "--port", "6379",
                "--save", "", "--appendonly", "no", "--dir", str(self.logdir)]

    def deploy(self) -> str:
        a, b = self.hosts["A"], self.hosts["B"]
        for name, host in self.hosts.items():
            self.nats[name] = self.procs.start(host, self.nats_argv(name), f"nats-{name}")
        self.redis = self.procs.start(a, self.redis_argv(), "redis")
        def serve(host: str, *extra: str, deterministic: bool = True) -> list[str]:
            """`evenflow serve` on `host`, its own NATS server first in the cluster's list."""
            order = [host] + [n for n in self.hosts if n != host]
            return [sys.executable, "-m", "evenflow.cli", "serve", "--nats-url",
                    ",".join(f"nats://{self.hosts[n].address}:4222" for n in order),
                    "--redis-url", f"redis://{a.address}:6379", "--model", "tiny-moe",
                    "--dtype", "float32", *(["--deterministic"] if deterministic else []),
                    *extra]

        self.procs.start(a, serve("A", "--roles", "gateway,kv_index", "--host", a.address,
                                  "--port", "8000"), "serve-A")
        for name, index in (("B", 1), ("C", 2)):
            self.procs.start(self.hosts[name], serve(name, "--roles", "prefill,decode",
                                                     "--index", str(index)), f"serve-{name}")
        # (deterministic mode does not serve expert parallelism: the group's streams are not
        # held to the fault-free text; the gateway moves a deterministic worker's streams to
        # the other deterministic worker while one is live, by the heartbeats' numerics)
        dep = ("--roles", "decode", "--index", "5", "--ep", "2", "--ep-rendezvous",
               f"{b.address}:{RENDEZVOUS_PORT}")
        self.procs.start(b, serve("B", *dep, "--ep-ranks", "0", "--ep-rendezvous-serve",
                                  deterministic=False), "serve-dep-B")
        self.procs.start(self.hosts["C"], serve("C", *dep, "--ep-ranks", "1",
                                                deterministic=False), "serve-dep-C")
        return f"http://{a.address}:8000"

    def wait_ready(self, url: str, within_s: float) -> dict:
        script = f"import httpx; print(httpx.get('{url}/health', timeout=5).text)"
        deadline, last = time.monotonic() + within_s, {}
        while time.monotonic() < deadline:
            done = self.hosts["A"].run([sys.executable, "-c", script], timeout=20)
            try:
                last = json.loads(done.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                last = {}
            workers = last.get("workers", {})
            if last.get("status") == "ok" and workers.get("prefill", 0) >= 2 \
                    and workers.get("decode", 0) >= 3:
                return last
            time.sleep(3)
        raise RuntimeError(f"the mesh was not ready within {within_s:.0f} s: {last}")

    # processes inside the hosts
    def find(self, host: str, pattern: str) -> list[int]:
        return [p for p in self.hosts[host].pids() if re.search(pattern, _cmdline(p))]

    def back_within(self, host: str, pattern: str, old: set[int], limit_s: float = 60) -> float:
        """Seconds until a new process matching `pattern` runs on `host` (alive 1 s)."""
        started = time.monotonic()
        while time.monotonic() - started < limit_s:
            new = [p for p in self.find(host, pattern) if p not in old]
            if new:
                time.sleep(1.0)
                if any(Path(f"/proc/{p}").exists() for p in new):
                    return time.monotonic() - started - 1.0
            time.sleep(0.2)
        return float("inf")

    # the faults
    def fault(self, t: float, kinds: list[str]) -> dict:
        kind = self.rng.choice(kinds)
        record: dict = {"t": t, "kind": kind}
        if kind in ("kill_worker", "kill_dep_rank", "sigstop"):
            table = DEP_RANKS if kind == "kill_dep_rank" else WORKERS
            worker = self.rng.choice(list(table))
            host = table[worker]
            role = "decode" if worker.startswith("d") else "prefill"
            pattern = rf"evenflow\.{role} {worker}( |$)"
            pids = self.find(host, pattern)
            record["target"] = worker
            if not pids:
                record["skipped"] = "not running"
                return record
            if kind == "sigstop":
                for p in pids:
                    os.kill(p, signal.SIGSTOP)
                time.sleep(3)
                for p in pids:
                    os.kill(p, signal.SIGCONT)
                return record
            for p in pids:
                os.kill(p, signal.SIGKILL)
            record["recovery_s"] = self.back_within(host, pattern, set(pids))
        elif kind == "kill_nats":
            name = self.rng.choice(["B", "C"])
            record["target"] = f"nats-{name}"
            self.nats[name].kill()
            self.nats[name].wait()
            time.sleep(3)
            started = time.monotonic()
            self.nats[name] = self.procs.start(self.hosts[name], self.nats_argv(name),
                                               f"nats-{name}")
            record["recovery_s"] = 3.0 + time.monotonic() - started
        elif kind == "link_down":
            name = self.rng.choice(["B", "C"])
            record["target"] = f"link {name}"
            self.cluster.set_link(self.hosts[name], up=False)
            time.sleep(5)
            self.cluster.set_link(self.hosts[name], up=True)
        else:
            assert self.redis is not None
            record["target"] = "redis"
            self.redis.kill()
            self.redis.wait()
            self.redis = self.procs.start(self.hosts["A"], self.redis_argv(), "redis")
            record["recovery_s"] = 0.0
        return record

    def sample_rss(self, t: float) -> None:
        for name, host in self.hosts.items():
            for pid in host.pids():
                cmd = _cmdline(pid)
                m = re.search(r"evenflow\.(\w+) (\w+)", cmd)
                label = f"{m[1]} {m[2]}" if m else ("nats-" + name if "nats-server" in cmd
                                                    else "redis" if "redis-server" in cmd
                                                    else "")
                if label:
                    rss = _rss_mb(pid)
                    if rss:
                        self.rss.setdefault((label, pid), []).append((t, rss))


def _rss_growth(samples: dict[tuple[str, int], list[tuple[float, float]]]) -> dict[str, float]:
    """Per service: RSS growth (%) from its first sample at least 5 minutes into a process's
    life to its last (processes that lived under 5 minutes + a sample: not counted)."""
    growth: dict[str, float] = {}
    for (label, _pid), points in samples.items():
        born = points[0][0]
        later = [(t, r) for t, r in points if t - born >= 300]
        if len(later) >= 2:
            pct = 100 * (later[-1][1] - later[0][1]) / later[0][1]
            growth[label] = max(growth.get(label, -100.0), pct)
    return growth


def _migrated(logdir: Path) -> dict[str, str]:
    """Streams the gateway moved after some of their tokens: id -> the decode worker they were
    moved off (the gateway's request line names the first one that served them)."""
    text = (logdir / "serve-A.log").read_text(errors="replace")
    moved = {m[1] for m in re.finditer(r"request (\S+): \S+ \(.*?\) after (\d+) tokens; "
                                       r"sending it again", text) if int(m[2]) > 0}
    finished = {m[1]: m[2].rsplit("->", 1)[-1] for m in re.finditer(
        r"request (\S+) \w+ ok \(streamed\) on (\S+?):", text)}
    return {rid: finished.get(rid, "?") for rid in moved}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evenflow bench chaos", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault-every", type=float, nargs=2, default=(30.0, 90.0),
                    metavar=("MIN_S", "MAX_S"))
    ap.add_argument("--logdir", default=None, help="keep the services' logs here")
    ap.add_argument("--faults", default=",".join(FAULTS),
                    help=f"the kinds of fault to choose from, comma-separated (default: all: "
                         f"{', '.join(FAULTS)})")
    ap.add_argument("--load", nargs=3, metavar=("URL", "SECONDS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    kinds = [k for k in args.faults.split(",") if k]
    if not kinds or set(kinds) - set(FAULTS):
        ap.error(f"--faults: choose among {', '.join(FAULTS)}")
    if args.load:  # (the load process, on host A)
        url, seconds, out = args.load
        return load_main(url, float(seconds), out, args.clients, args.seed)

    from evenflow.bench.machine import machine_line
    from evenflow.dev.hosts import SimCluster, probe

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (the hosts are removed on exit)
    why = probe()
    if why is not None:
        print(f"bench chaos: simulated hosts unavailable here: {why}")
        return 2
    print(machine_line("float32", None))
    logdir = Path(args.logdir or tempfile.mkdtemp(prefix="evenflow-chaos-"))
    logdir.mkdir(parents=True, exist_ok=True)
    out = str(logdir / "requests.jsonl")
    seconds = args.minutes * 60
    with SimCluster.create(3, rate="10gbit") as cluster:
        chaos = Chaos(cluster, logdir, args.seed)
        try:
            url = chaos.deploy()
            print(f"deploying on 3 simulated hosts (logs: {logdir}) ...", flush=True)
            chaos.wait_ready(url, 300)
            load = chaos.procs.start(chaos.hosts["A"], [
                sys.executable, "-m", "evenflow.bench.mesh.chaos_bench", "--clients",
                str(args.clients), "--seed", str(args.seed), "--load", url, str(seconds), out],
                "load")
            while not Path(out + ".ready").exists():
                if load.poll() is not None:
                    raise RuntimeError(f"the load exited: {chaos.procs.log('load')[-2000:]}")
                time.sleep(1)
            t0 = time.time()
            print(f"load running for {args.minutes:g} min; a fault every "
                  f"{args.fault_every[0]:g}-{args.fault_every[1]:g} s", flush=True)
            next_fault = time.time() + chaos.rng.uniform(*args.fault_every)
            next_sample = time.time()
            while load.poll() is None:
                now = time.time()
                if now >= next_sample:
                    chaos.sample_rss(now - t0)
                    next_sample = now + 20
                if now >= next_fault and now - t0 < seconds - 20:
                    record = chaos.fault(now, kinds)
                    chaos.faults.append(record)
                    print(f"  {now - t0:7.1f} s  {record['kind']:>14} {record.get('target', '')}"
                          + (f"  back in {record['recovery_s']:.1f} s"
                             if "recovery_s" in record else "")
                          + (f"  ({record['skipped']})" if "skipped" in record else ""),
                          flush=True)
                    next_fault = time.time() + chaos.rng.uniform(*args.fault_every)
                time.sleep(0.5)
        finally:
            chaos.procs.stop()
        rows = [json.loads(line) for line in Path(out).read_text().splitlines() if line]
        migrated = _migrated(logdir)
    return _report(rows, chaos, migrated)


def _report(rows: list[dict], chaos: Chaos, migrated: dict[str, str]) -> int:
    outcomes: dict[str, int] = {}
    for row in rows:
        outcomes[row["outcome"]] = outcomes.get(row["outcome"], 0) + 1
    lost = sum(n for o, n in outcomes.items() if o.startswith("lost"))
    errors = sum(n for o, n in outcomes.items() if o.startswith(("error", "http_5")))
    moved = [r for r in rows if r.get("kind") == "stream" and r.get("id") in migrated
             and r["outcome"] == "ok" and r.get("reference") is not None]
    to_dep = [r for r in moved if migrated[r["id"]].startswith("d5")]  # (never deterministic)
    moved = [r for r in moved if r not in to_dep]
    identical = sum(r["text"] == r["reference"] for r in moved)
    print(f"\nrequests by outcome ({len(rows)} in all):")
    for outcome, n in sorted(outcomes.items(), key=lambda kv: -kv[1]):
        print(f"  {outcome:>28} {n:7d}")
    print("\nfaults (p99 of the longest chunk gap of the streams running in the 15 s after):")
    for f in chaos.faults:
        gaps = [r["gap"] for r in rows if "gap" in r and r["t0"] <= f["t"] + 15
                and r["t1"] >= f["t"]]
        p99 = statistics.quantiles(gaps, n=100)[98] if len(gaps) >= 2 else \
            (gaps[0] if gaps else 0.0)
        back = f"{f['recovery_s']:.1f} s" if "recovery_s" in f else "-"
        print(f"  {f['kind']:>14} {f.get('target', ''):>10}  gap p99 {p99:6.2f} s  back {back}")
    print(f"\nstreams moved after some tokens: {len(moved) + len(to_dep)} ({len(to_dep)} "
          "moved off the DEP group, which is not deterministic: not compared)")
    growth = _rss_growth(chaos.rss)
    print("\nRSS growth after each service's first 5 minutes:")
    for label, pct in sorted(growth.items()):
        print(f"  {label:>20} {pct:+6.1f}%")
    recoveries = [f["recovery_s"] for f in chaos.faults if "recovery_s" in f]
    print(f"chaos: {len(rows)} requests, lost {lost}, errors {errors}, migrated identical "
          f"{identical}/{len(moved)}, rss growth max "
          f"{max(growth.values(), default=0.0):.1f}%, recovery max "
          f"{max(recoveries, default=0.0):.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
