"""Simulated hosts on one machine, for tests and benchmarks of what spans several machines.

Each host is a network namespace with its own address and loopback, joined to the others
through a bridge that lives in a namespace of its own (nothing is added to the machine's own
network namespace), and a private tmpfs on /dev/shm in a mount namespace of its own: shared
memory between two "hosts" fails as it would between two machines. A holder process keeps each
host's namespaces alive; `SimHost.command(argv)` runs argv inside them (nsenter). Links can get
a datacenter's latency, rate and loss (tc netem) and be taken down and up.

Everything is named `evh-<tag>-<i>` / `evsw-<tag>` and removed by `SimCluster.close()`: every
process inside the hosts killed, the namespaces (and so their links, mounts and addresses)
deleted. `evenflow dev hosts up N` / `down` do the same from a shell (root, iproute2, nsenter).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

STATE_DIR = Path(tempfile.gettempdir()) / "evenflow-hosts"
SUBNET = "10.231.{cluster}.{host}"  # addresses only inside the namespaces made here


class HostsUnavailable(RuntimeError):
    """This machine cannot make namespaces (not root, no iproute2 / nsenter, a sandbox)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def probe() -> str | None:
    """None where simulated hosts can be made here, else why not."""
    if os.geteuid() != 0:
        return "not root: network namespaces need CAP_SYS_ADMIN"
    missing = [tool for tool in ("ip", "nsenter", "unshare") if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed"
    name = f"evprobe-{uuid.uuid4().hex[:6]}"
    try:
        made = _ip("netns", "add", name, check=False)
        if made.returncode:
            return f"cannot create a network namespace: {made.stderr.strip()}"
        shm = subprocess.run(["ip", "netns", "exec", name, "unshare", "-m",
                              "--propagation", "private", "sh", "-c",
                              "mount -t tmpfs evprobe /dev/shm"],
                             capture_output=True, text=True)
        if shm.returncode:
            return f"cannot mount a private /dev/shm: {shm.stderr.strip()}"
        return None
    except FileNotFoundError as exc:
        return f"{exc.filename} is not installed"
    finally:
        _ip("netns", "del", name, check=False)


@dataclass
class SimHost:
    name: str  # the network namespace
    index: int
    address: str
    holder: subprocess.Popen

    def command(self, argv: list[str]) -> list[str]:
        """argv run inside this host's network and mount namespaces."""
        return ["nsenter", "-t", str(self.holder.pid), "-m", "-n", "--", *argv]

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(argv), **kwargs)

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(argv), **kwargs)

    def pids(self) -> list[int]:
        out = _ip("netns", "pids", self.name, check=False).stdout
        return [int(p) for p in out.split()]


class HostProcesses:
    """Services started on simulated hosts, each writing to its own log file in `logdir`:
    stopped together (SIGTERM, SIGKILL after a grace), their logs closed."""

    def __init__(self, logdir: Path, env: dict[str, str] | None = None) -> None:
        self.logdir, self.env = Path(logdir), env
        self.procs: list[subprocess.Popen] = []
        self._logs: list = []

    def start(self, host: SimHost, argv: list[str], name: str) -> subprocess.Popen:
        """argv on `host`, its output appended to `name`.log."""
        log = (self.logdir / f"{name}.log").open("a")
        self._logs.append(log)
        self.procs.append(host.popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                     env=self.env))
        return self.procs[-1]

    def log(self, name: str) -> str:
        return (self.logdir / f"{name}.log").read_text()

    def stop(self, grace_s: float = 15.0) -> None:
        for proc in reversed(self.procs):  # (the last started first: clients before servers)
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._logs:
            log.close()


@dataclass
class SimCluster:
    tag: str
    hosts: list[SimHost] = field(default_factory=list)
    switch: str = ""

    @classmethod
    def create(cls, count: int, tag: str | None = None, delay_ms: float = 0.0,
               rate: str | None = None, loss_pct: float = 0.0) -> SimCluster:
        """`count` hosts on one bridge; each link (host -> bridge) with netem's delay, rate
        ("10gbit") and loss where given. On any failure, what was made is removed."""
        why = probe()
        if why is not None:
            raise HostsUnavailable(why)
        tag = tag or uuid.uuid4().hex[:6]
        cluster = cls(tag, switch=f"evsw-{tag}")
        net = int(tag, 16) % 250 + 1 if all(c in "0123456789abcdef" for c in tag) else 1
        try:
            _ip("netns", "add", cluster.switch)
            _ip("-n", cluster.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", cluster.switch, "link", "set", "br0", "up")
            for i in range(count):
                cluster.hosts.append(cluster._add_host(i, SUBNET.format(cluster=net, host=i + 1)))
                if delay_ms or rate or loss_pct:
                    cluster.netem(cluster.hosts[-1], delay_ms, rate, loss_pct)
            cluster._save()
        except BaseException:
            cluster.close()
            raise
        return cluster

    def _add_host(self, index: int, address: str) -> SimHost:
        name = f"evh-{self.tag}-{index}"
        _ip("netns", "add", name)
        _ip("link", "add", "eth0", "netns", name, "type", "veth", "peer", "name", f"p{index}",
            "netns", self.switch)
        _ip("-n", self.switch, "link", "set", f"p{index}", "master", "br0", "up")
        _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", name, "link", "set", "eth0", "up")
        _ip("-n", name, "link", "set", "lo", "up")
        holder = subprocess.Popen(
            ["ip", "netns", "exec", name, "unshare", "-m", "--propagation", "private", "sh",
             "-c", f"mount -t tmpfs evshm-{self.tag}-{index} /dev/shm && echo ready && "
                   "exec sleep infinity"],
            stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != "ready":
            holder.kill()
            raise HostsUnavailable(f"host {name}: the private /dev/shm did not mount")
        return SimHost(name, index, address, holder)

    def netem(self, host: SimHost, delay_ms: float = 0.0, rate: str | None = None,
              loss_pct: float = 0.0) -> None:
        """Replace the host's link shaping: netem for delay (each way, on its egress) and loss
        (with the rate), tbf for a rate alone. HostsUnavailable where the kernel lacks netem
        (no sch_netem: some VMs and sandboxes)."""
        if delay_ms or loss_pct:
            args = ["netem"]
            if delay_ms:
                args += ["delay", f"{delay_ms}ms"]
            if rate:
                args += ["rate", rate]
            if loss_pct:
                args += ["loss", f"{loss_pct}%"]
        elif rate:
            args = ["tbf", "rate", rate, "burst", "1mb", "latency", "10ms"]
        else:
            args = ["pfifo_fast"]
        if shutil.which("tc") is None:
            raise HostsUnavailable("tc (iproute2) is not installed: links cannot be shaped")
        done = subprocess.run(["ip", "netns", "exec", host.name, "tc", "qdisc", "replace", "dev",
                               "eth0", "root", *args], capture_output=True, text=True)
        if done.returncode:
            raise HostsUnavailable(f"tc {' '.join(args)} on {host.name}: "
                                   f"{done.stderr.strip() or done.returncode}")

    def set_link(self, host: SimHost, up: bool) -> None:
        _ip("-n", host.name, "link", "set", "eth0", "up" if up else "down")

    def kill_processes(self, host: SimHost, sig: int = signal.SIGKILL) -> None:
        """Every process of the host but its namespace holder."""
        for pid in host.pids():
            if pid != host.holder.pid:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        """Kill every process in the hosts, delete every namespace (links, addresses and
        mounts go with them). Safe to call twice, and after a partial create."""
        for host in self.hosts:
            self.kill_processes(host)
            host.holder.kill()
            host.holder.wait()
        deadline = time.monotonic() + 5
        for host in self.hosts:
            while host.pids() and time.monotonic() < deadline:
                time.sleep(0.05)
        remove_namespaces(self.tag)
        (STATE_DIR / f"{self.tag}.json").unlink(missing_ok=True)

    def _save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        (STATE_DIR / f"{self.tag}.json").write_text(json.dumps({
            "tag": self.tag, "switch": self.switch,
            "hosts": [{"name": h.name, "address": h.address, "holder": h.holder.pid}
                      for h in self.hosts]}))

    def __enter__(self) -> SimCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def remove_namespaces(tag: str | None = None) -> list[str]:
    """Delete the namespaces of cluster `tag` (every evenflow cluster's when None), killing
    what runs in them first; the names removed."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    names = [line.split()[0] for line in listed if line.strip()]
    prefixes = (f"evh-{tag}-", f"evsw-{tag}") if tag else ("evh-", "evsw-")
    removed = []
    for name in names:
        if not name.startswith(prefixes):
            continue
        for pid in _ip("netns", "pids", name, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "del", name, check=False)
        removed.append(name)
    return removed


def main(argv: list[str]) -> int:
    """`evenflow dev hosts up N [--tag T] [--rate R] [--delay-ms D]` | `down [--tag T]` |
    `list` | `exec TAG INDEX CMD...`."""
    import argparse

    ap = argparse.ArgumentParser(prog="evenflow dev hosts", description=__doc__)
    sub = ap.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="make N simulated hosts and leave them running")
    up.add_argument("count", type=int)
    up.add_argument("--tag", default=None, help="names evh-<tag>-<i> (default: random)")
    up.add_argument("--rate", default=None, help="each link's rate, e.g. 10gbit")
    up.add_argument("--delay-ms", type=float, default=0.0, help="each link's delay (netem)")
    down = sub.add_parser("down", help="remove simulated hosts and everything in them")
    down.add_argument("--tag", default=None, help="one cluster (default: every evenflow one)")
    sub.add_parser("list", help="the clusters made with `up`")
    run = sub.add_parser("exec", help="run a command on a host")
    run.add_argument("tag")
    run.add_argument("index", type=int)
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.action == "up":
        try:
            cluster = SimCluster.create(args.count, args.tag, args.delay_ms, args.rate)
        except HostsUnavailable as exc:
            print(f"evenflow dev hosts: {exc}")
            return 1
        for host in cluster.hosts:
            print(f"{host.name}  {host.address}  (evenflow dev hosts exec {cluster.tag} "
                  f"{host.index} CMD...)")
        print(f"remove with: evenflow dev hosts down --tag {cluster.tag}")
        return 0
    if args.action == "down":
        removed = remove_namespaces(args.tag)
        for saved in STATE_DIR.glob(f"{args.tag or '*'}.json"):
            saved.unlink()
        print(f"removed {len(removed)} namespace(s)")
        return 0
    states = [json.loads(p.read_text()) for p in sorted(STATE_DIR.glob("*.json"))]
    if args.action == "list":
        for state in states:
            print(state["tag"], " ".join(f"{h['name']}={h['address']}" for h in state["hosts"]))
        return 0
    state = next((s for s in states if s["tag"] == args.tag), None)
    if state is None or not 0 <= args.index < len(state["hosts"]):
        print(f"evenflow dev hosts: no host {args.index} in cluster {args.tag!r}")
        return 2
    holder = state["hosts"][args.index]["holder"]
    return subprocess.call(["nsenter", "-t", str(holder), "-m", "-n", "--", *args.cmd])
