"""Mesh configuration: one frozen dataclass, built once at the edge from `EVENFLOW_*`
environment variables and CLI overrides. This is the only module that reads the environment
(besides OpenTelemetry's own OTEL_* variables). An unknown EVENFLOW_ key is an error, and so is
a value out of its range (the error names the variable).

Engine settings take their defaults from the engine's own EngineConfig (torch-free), so the
offline engine and the mesh cannot disagree; `engine_config()` maps them across."""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from evenflow import models
from evenflow.engine.config.settings import ENGINE_SWITCHES, EngineConfig, check_engine_switch
from evenflow.services import logs
from evenflow.services.bus import NatsSecurity
from evenflow.services.reassembly import ReassemblyBudget

ENV_PREFIX = "EVENFLOW_"
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    pass


# Numeric settings' ranges: (low, high or None, low inclusive). Engine settings are checked by
# EngineConfig itself.
_RANGES: dict[str, tuple[float, float | None, bool]] = {
    "port": (0, 65535, True), "threads_per_worker": (1, None, True),
    "max_model_len": (0, None, True), "num_kv_blocks": (0, None, True),
    "local_prefill_threshold": (0, None, True), "decode_retries": (0, 100, True),
    "kv_overlap_weight": (0, None, True), "decode_load_weight": (0, None, True),
    "load_cap_blocks": (0, None, False), "router_temperature": (0, None, True),
    "prediction_ttl_ms": (0, None, True), "kv_lookup_timeout_s": (0, None, False),
    "heartbeat_interval_s": (0, None, False), "worker_timeout_s": (0, None, False),
    "request_timeout_s": (0, None, False), "kv_transfer_timeout_s": (0, None, False),
    "kv_pull_min_tokens": (0, None, True), "kv_pull_timeout_s": (0, None, False),
    "stall_timeout_s": (0, None, False), "drain_timeout_s": (0, None, True),
    "orphan_ttl_s": (0, None, False), "queue_timeout_s": (0, None, True),
    "migration_wait_s": (0, None, True),
    "max_body_bytes": (1024, None, True), "max_header_bytes": (1024, None, True),
    "max_inflight": (1, None, True), "max_queued": (0, None, True),
    "kv_chunk_bytes": (4096, None, True), "bus_peer_reassembly_mb": (1, None, True),
    "bus_total_reassembly_mb": (1, None, True), "num_ep_ranks": (0, None, True),
    "num_redundant_experts": (0, None, True), "eplb_report_interval_s": (0, None, False),
    "eplb_threshold": (0, 1, True), "eplb_min_interval_reports": (1, None, True),
    "eplb_window_reports": (1, None, True), "balancer_metrics_port": (0, 65535, True),
    "num_prefill": (0, None, True), "num_decode": (1, None, True),
    "num_gateways": (1, 64, True), "kv_disk_gb": (0, None, True), "kv_disk_credit": (0, 1, True),
}
_CHOICES: dict[str, tuple[str, ...]] = {
    "router": ("kv", "least_load", "round_robin"), "engine": ("torch", "mock"),
    "log_level": LOG_LEVELS,
}


_ENGINE = EngineConfig()  # the engine's defaults are the mesh's: one source


@dataclass(frozen=True)
class MeshConfig:
    # Data plane; None means `evenflow up` starts a local server on a free port.
    nats_url: str | None = None
    redis_url: str | None = None
    mesh_name: str = "default"  # Redis keys are per (model, mesh): meshes can share a Redis
    # NATS security. `evenflow up` (starting its own nats-server) creates a user per service
    # with subject permissions (services/nats_auth.py) unless nats_auth is off; a service
    # connects with the credentials file it is given, and over TLS when certificates are set.
    nats_auth: bool = True
    nats_credentials_file: str | None = None
    nats_tls_ca: str | None = None
    nats_tls_cert: str | None = None
    nats_tls_key: str | None = None
    # Model and engine (every worker uses the same); defaults are EngineConfig's.
    model: str = _ENGINE.model
    engine: str = "torch"  # "torch", or "mock": a timing model over the real block manager
    mock_timing_scale: float = 1.0  # the mock engine's step times x this (0: no compute)
    dtype: str = _ENGINE.dtype
    block_size: int = _ENGINE.block_size
    max_num_seqs: int = _ENGINE.max_num_seqs
    max_num_batched_tokens: int = _ENGINE.max_num_batched_tokens
    max_model_len: int = 0  # 0: the model's, at most 8192
    kv_cache_gb: float = _ENGINE.kv_cache_gb
    num_kv_blocks: int = 0  # 0: derived from kv_cache_gb
    # the KV cache's storage: auto (the model's dtype) or int8 (engine/model/kv_quant.py); the
    # hand-off then carries int8 blocks with their scales
    kv_cache_dtype: str = _ENGINE.kv_cache_dtype
    # A KV disk tier per worker (engine/runners/kv_tiers.py): blocks evicted from RAM go to
    # disk, kv_disk_gb at most, and come back on a prefix hit. Without kv_disk_dir each worker's
    # tier is a temporary directory, removed when the worker exits; with it, the tier is
    # persistent at kv_disk_dir/<worker id> and a restarted worker finds it warm.
    kv_disk_gb: float = 0.0
    kv_disk_dir: str = ""
    # The router's credit for a block a worker holds on its disk tier, in RAM blocks (a RAM hit
    # is 1, a recompute 0): 1 - promotion time / recompute time per block, which `evenflow bench
    # tiers` measures (0.99 on the 110M model here, the pool in the page cache; 0.9 leaves room
    # for a tier read from the device itself. Dynamo's KVBM gives disk 0.25).
    kv_disk_credit: float = 0.9
    threads_per_worker: int = 1  # torch threads of each worker's engine
    # Deterministic (batch-invariant) engines (EngineConfig.deterministic): a stream migrated
    # to another worker continues text-identically, in bf16 too; prefill costs more
    deterministic: bool = _ENGINE.deterministic
    # Weight-only quantization at load: "" (none), int8 or int4 (engine/quant/stacks.py;
    # EngineConfig checks the value)
    quantization: str = ""
    quant_group_size: int = _ENGINE.quant_group_size
    quant_symmetric: bool = _ENGINE.quant_symmetric
    # Tensor parallelism: every worker is this many rank processes (threads_per_worker each)
    tensor_parallel_size: int = _ENGINE.tensor_parallel_size
    log_level: str = "info"
    served_model_name: str = ""  # the `model` clients send (default: from --model)
    stats_log_interval_s: float = 10.0  # each engine worker logs a stats line this often (0: off)
    # Test knob: engine workers sleep this long after every step, to make a straggler on
    # purpose (`evenflow doctor` must name it): "25" for every worker, "d1=25,p0=5" for some
    debug_step_delay_ms: str = ""
    # Gateway
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()  # empty: no authentication (see api_key_file)
    api_key_file: str | None = None  # keys, one per line; read by the gateway at start
    public_metrics: bool = False  # with keys set, /metrics and /docs need a key unless True
    # Limits at the HTTP edge (README "Limits")
    max_body_bytes: int = 4 * 2**20  # larger bodies: 413
    max_header_bytes: int = 64 * 1024  # larger header sections: 431
    max_inflight: int = 256  # requests running at once at this gateway
    max_queued: int = 512  # requests waiting for a slot; beyond: 429 with Retry-After
    # Conditional disaggregation (as Dynamo's max_local_prefill_length): a prompt whose part not
    # cached on its decode worker is shorter than this many tokens is prefilled there, not
    # shipped; a chat's next turn thus reuses the previous answer, which only the decode worker
    # holds. 0 disables (every prompt goes to a prefill worker).
    local_prefill_threshold: int = 128
    # Each gateway keeps its own copy of the KV block index from the KV-event stream and routes
    # from it; Redis answers while the copy is behind (kv_index/local_copy.py). False: Redis only.
    kv_index_local_copy: bool = True
    # K/V that fits in one chunk goes inside the hand-off's completion message (one message, not
    # two); off only to measure what it saves (bench serve)
    kv_inline_handoff: bool = True
    decode_retries: int = 2  # other workers tried when one fails or stops responding
    # A request no live decode worker has KV room for waits this long for one (as in vLLM's
    # waiting queue), then fails with 503.
    queue_timeout_s: float = 60.0
    # A stream whose decode worker died, when no decode worker is live at all, waits this long
    # for one to come back (an elastic DEP group re-forming, a supervised restart) before it
    # ends with an error
    migration_wait_s: float = 10.0
    # Routing: "kv" (cost = w * blocks to prefill + load), "least_load" or "round_robin".
    router: str = "kv"
    # w: cost of one block to prefill against one block of queued work. At 1 the cost is the
    # expected time to first token in block units; above 1 reuse wins over balance (a burst
    # sharing a prefix sticks together longer).
    kv_overlap_weight: float = 1.0
    decode_load_weight: float = 4.0  # one running decode sequence, in blocks
    load_cap_blocks: float = 256.0  # never route to a worker this much busier than the idlest
    router_temperature: float = 0.0  # > 0: sample workers by softmax(-cost / T)
    prediction_ttl_ms: int = 2000  # requests just routed count as cached this long
    kv_lookup_timeout_s: float = 0.05  # Redis slower than this: route by load alone
    # Timing
    heartbeat_interval_s: float = 0.5
    worker_timeout_s: float = 3.0  # a worker silent this long is dead
    # A request's deadline (a request may ask for less with its `timeout` field): past it the
    # stream ends with a 504 error event and the workers drop the request.
    request_timeout_s: float = 600.0
    stall_timeout_s: float = 120.0  # a request with no progress this long fails (504)
    drain_timeout_s: float = 30.0  # gateway SIGTERM: streams get this long to finish
    # Workers drop the requests of a gateway silent this long (its clients are gone with it).
    orphan_ttl_s: float = 10.0
    kv_transfer_timeout_s: float = 10.0
    # KV pulls (services/kv_pull.py): a prefill worker lacking at least this many of a prompt's
    # leading tokens which another live worker holds (the decode worker holding a chat's
    # history) pulls their blocks from it over NATS instead of recomputing them; below it,
    # recomputing is faster. `evenflow bench serve` measures the crossover (pull time against
    # recompute time per token): 26 tokens on the 110M model here (a pull's fixed cost ~4 ms,
    # then 10 us a token against recompute's 173), so 32: two blocks of 16. 0: never pull.
    # A pull that takes longer than kv_pull_timeout_s is given up, and the prompt recomputed.
    kv_pull_min_tokens: int = 32
    kv_pull_timeout_s: float = 1.0
    kv_chunk_bytes: int = 512 * 1024  # below NATS' default 1 MiB max_payload
    # Incomplete framed bus messages a process holds, per sending peer and in total
    bus_peer_reassembly_mb: int = 64
    bus_total_reassembly_mb: int = 256
    # Expert parallelism and the balancer (MoE models; virtual EP ranks inside each worker)
    num_ep_ranks: int = 4  # 0: no expert placement, no balancer
    num_redundant_experts: int = 4  # extra slots for replicas of hot experts
    eplb_report_interval_s: float = 1.0  # workers report per-slot load this often
    eplb_threshold: float = 0.9  # rebalance when windowed rank balancedness drops below
    eplb_min_interval_reports: int = 5  # reports between two rebalances, at least
    eplb_window_reports: int = 10  # reports of load a decision looks at
    balancer_metrics_port: int = 0  # > 0: the balancer serves Prometheus metrics there
    # Every worker process (prefill, decode, kv_index, balancer) serves its own Prometheus
    # /metrics here when > 0 (`evenflow up` gives each one a free port and prints them)
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    # Operator profiles: with a directory set, the gateway serves POST /admin/profile and
    # workers write their Chrome traces there (off by default, as vLLM's profiler dir)
    profile_dir: str = ""
    eplb_per_role: bool = True  # a placement per role (prefill, decode); False: one for all
    # Fleet (for `evenflow up`)
    # Gateway processes sharing the HTTP port (SO_REUSEPORT: the kernel spreads connections
    # over them); each has its own NATS inbox and, with more than one, its own metrics port.
    num_gateways: int = 1
    num_prefill: int = 1
    num_decode: int = 1
    # DEP (engine/dep/lockstep.py): every worker is a group of this many rank processes, each a
    # worker of its own (d0r0, d0r1, ...) whose MoE layers are expert-parallel over the group;
    # then num_ep_ranks is the group size. ep_rank / ep_group are set per process by the
    # launcher (EVENFLOW_EP_RANK, EVENFLOW_EP_GROUP).
    expert_parallel_size: int = 1
    ep_rank: int = 0
    ep_group: str = ""
    # DEP groups across hosts (`evenflow serve --ep-ranks 0,1 --ep-rendezvous HOST:PORT`): the
    # planned ranks this host runs of each group ("" = all), and the groups' rendezvous store;
    # with a rendezvous, groups are elastic (engine/dep/lockstep.py).
    ep_ranks: str = ""
    ep_rendezvous: str = ""
    ep_settle_s: float = 3.0
    # Under Ray (`evenflow up --ray --ep N --ep-nodes K`): each DEP group's ranks spread over
    # K nodes (N / K on each) through a placement group, meeting through a rendezvous store
    # its replica serves (evenflow/rayserve/app.py).
    ep_nodes: int = 1
    # The engine's process-wide switches (engine/config/settings.py ENGINE_SWITCHES:
    # EVENFLOW_NATIVE_*, EVENFLOW_FAST_DECODE), as "NAME=value", from their own variables; every
    # worker gets them.
    engine_switches: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, (low, high, inclusive) in _RANGES.items():
            value = getattr(self, name)
            if value < low or (high is not None and value > high) or (
                    not inclusive and value == low):
                bound = f">= {low}" if inclusive else f"> {low}"
                if high is not None:
                    bound += f" and <= {high}"
                raise ConfigError(f"{name} ({ENV_PREFIX}{name.upper()}) must be {bound}, "
                                  f"got {value!r}")
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} ({ENV_PREFIX}{name.upper()}) must be one of "
                                  f"{', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.expert_parallel_size > 1 and self.num_ep_ranks != self.expert_parallel_size:
            object.__setattr__(self, "num_ep_ranks", self.expert_parallel_size)
        if self.num_prefill == 0 and self.local_prefill_threshold == 0:
            raise ConfigError("with no prefill workers, local prefill must be enabled")
        try:
            self.step_delay_s("")
        except ValueError:
            raise ConfigError("debug_step_delay_ms (EVENFLOW_DEBUG_STEP_DELAY_MS) must be MS or "
                              f"WORKER=MS,..., got {self.debug_step_delay_ms!r}") from None
        try:
            self.engine_config()
            for name, value in self.switch_values().items():
                check_engine_switch(name, value)
        except KeyError as exc:
            raise ConfigError(f"unknown engine switch {exc.args[0]}") from None
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def switch_values(self) -> dict[str, str]:
        """The engine switches set for this mesh, by variable name."""
        return _switch_pairs(self.engine_switches)

    def apply_engine_switches(self) -> None:
        """Hand the switches to this process's engine (which reads them from the environment:
        engine/config/settings.py engine_switch), before it is built: a worker whose config came
        from arguments rather than its environment (a Ray Serve replica) gets them too."""
        os.environ.update(self.switch_values())

    @property
    def redis_prefix(self) -> str:
        """Every Redis key of this mesh starts with this (kv_index/store.py spells the rest)."""
        return f"ev:{self.model_name}:{self.mesh_name}:"

    def nats_security(self) -> NatsSecurity:
        return NatsSecurity(self.nats_credentials_file, self.nats_tls_ca, self.nats_tls_cert,
                            self.nats_tls_key)

    def reassembly_budget(self) -> ReassemblyBudget:
        return ReassemblyBudget(peer_bytes=self.bus_peer_reassembly_mb * 2**20,
                                total_bytes=self.bus_total_reassembly_mb * 2**20)

    def configure_logging(self, identity: str = "") -> None:
        """The process's log format and level (every service's entry point calls this):
        time, level, `role/worker-id`, logger, message."""
        who = f" [{identity}]" if identity else ""
        logs.configure(self.log_level, f"%(asctime)s %(levelname)s{who} %(name)s %(message)s")

    def step_delay_s(self, worker_id: str) -> float:
        """debug_step_delay_ms for this worker, in seconds (0: none)."""
        delay = 0.0
        for part in filter(None, (p.strip() for p in self.debug_step_delay_ms.split(","))):
            who, _, ms = part.rpartition("=")
            value = float(ms) / 1e3  # every part parses (checked at construction)
            if value < 0:
                raise ValueError("a delay must be >= 0")
            if who in ("", worker_id):
                delay = value
        return delay

    @property
    def model_name(self) -> str:
        """The name clients use in the `model` field: --served-model-name, else a Hugging
        Face id as given, else a GGUF file's general.name, else the built-in name or the
        directory's."""
        if self.served_model_name:
            return self.served_model_name
        if models.is_hub_id(self.model):
            return self.model
        if self.model.endswith(".gguf") and os.path.isfile(self.model):
            from evenflow.models.gguf_import import served_name

            return served_name(os.path.abspath(self.model))
        return os.path.basename(self.model.rstrip("/")) or self.model

    def engine_config(self, kv_disk_dir: str = "") -> EngineConfig:
        """The engine settings every worker runs with: the fields both configs share by name,
        with 0 meaning "unset" where the engine takes None. The KV disk tier is per worker:
        only with its directory (services/engine_worker.py EngineWorker.engine_config)."""
        shared = {f.name for f in dataclasses.fields(EngineConfig)} & {
            f.name for f in dataclasses.fields(self)}
        values: dict[str, Any] = {name: getattr(self, name) for name in shared}
        values["num_kv_blocks"] = self.num_kv_blocks or None
        values["max_model_len"] = self.max_model_len or None
        values["num_threads"] = self.threads_per_worker
        values["quantization"] = self.quantization or None
        values["kv_disk_dir"] = kv_disk_dir
        values["kv_disk_gb"] = self.kv_disk_gb if kv_disk_dir else 0.0
        return EngineConfig(**values)

    def to_env(self) -> dict[str, str]:
        """EVENFLOW_* variables that rebuild this config in a child process."""
        env = dict(self.switch_values())  # each switch as its own variable
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or f.name == "engine_switches":
                continue
            env[ENV_PREFIX + f.name.upper()] = (
                ",".join(value) if isinstance(value, tuple) else str(value))
        return env


def _switch_pairs(items: tuple[str, ...]) -> dict[str, str]:
    """("NAME=value", ...) -> {NAME: value}."""
    return {name: value for name, _, value in (item.partition("=") for item in items)}


def redact(url: str | None) -> str:
    """A URL fit to print: credentials replaced by ***."""
    if not url or "@" not in url:
        return url or ""
    scheme, _, rest = url.rpartition("://")
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}" if scheme else "***@" + url.rsplit("@")[1]


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _coerce(name: str, hint: Any, raw: Any) -> Any:
    """A string from the environment or a flag -> the field's type (by its resolved hint)."""
    if not isinstance(raw, str):
        return raw
    base = hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None -> X
        base = next(a for a in typing.get_args(hint) if a is not type(None))
    try:
        if base is bool:
            if raw.lower() not in _TRUE + _FALSE:
                raise ValueError(raw)
            return raw.lower() in _TRUE
        if base in (int, float):
            return base(raw)
        if typing.get_origin(base) is tuple:
            return tuple(x for x in raw.split(",") if x)
    except ValueError as exc:
        kind = getattr(base, "__name__", str(base))
        raise ConfigError(f"{name}: cannot parse {raw!r} as {kind}") from exc
    return raw


def load_mesh_config(overrides: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> MeshConfig:
    """Environment first, then overrides (CLI flags); None values in overrides are skipped."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(MeshConfig)
    values: dict[str, Any] = {}
    switches: dict[str, str] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX):].lower()
        if key in ENGINE_SWITCHES:
            switches[key] = raw
        elif name not in hints or name == "engine_switches":
            raise ConfigError(f"unknown setting {key}; `evenflow up --help-env` lists them")
        else:
            values[name] = _coerce(key, hints[name], raw)
    for name, value in (overrides or {}).items():
        key = ENV_PREFIX + name.upper()
        if key in ENGINE_SWITCHES:  # (Ray Serve's application args name them this way)
            if value is not None:
                switches[key] = str(value)
        elif name not in hints:
            raise ConfigError(f"unknown setting {name!r}")
        elif value is not None:
            values[name] = _coerce(name, hints[name], value)
    given = _switch_pairs(values.get("engine_switches", ()))
    values["engine_switches"] = tuple(f"{k}={v}" for k, v in sorted((given | switches).items()))
    return MeshConfig(**values)


def env_help() -> str:
    """Every EVENFLOW_* setting with its default: the mesh's, then the engine's switches."""
    lines = ["Mesh settings (each also a flag where `evenflow up --help` lists one):"]
    for f in dataclasses.fields(MeshConfig):
        if f.name in ("engine_switches", "ep_rank", "ep_group"):
            continue
        default = f.default
        shown = ",".join(default) if isinstance(default, tuple) else default
        lines.append(f"  {ENV_PREFIX}{f.name.upper()}={'' if shown is None else shown}")
    lines.append("Engine switches (the same offline, under `evenflow up`, Ray Serve and compose):")
    for switch in ENGINE_SWITCHES.values():
        lines.append(f"  {switch.name}={switch.default}  {switch.help}")
    return "\n".join(lines)
