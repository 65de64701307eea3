"""Mesh configuration: one frozen dataclass, built once at the edge from `EVENFLOW_*`
environment variables and CLI overrides. This is the only module that reads the environment
(besides OpenTelemetry's own OTEL_* variables). An unknown EVENFLOW_ key is an error, and so is
a value out of its range (the error names the variable).

MeshConfig inherits the engine's settings from EngineConfig (torch-free), so the offline engine
and the mesh cannot disagree; every setting of both is declared once, with its range, choices,
flag and help (engine/config/fields.py), and the variables, flags, checks, `--help-env` and
docs/configuration.md come from those declarations."""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from evenflow import models
from evenflow.engine.config.fields import (
    ENV_PREFIX,
    check_settings,
    default_of,
    env_name,
    overridden,
    setting,
    settings_of,
)
from evenflow.engine.config.settings import ENGINE_SWITCHES, EngineConfig, check_engine_switch
from evenflow.services import logs
from evenflow.services.bus import NatsSecurity
from evenflow.services.reassembly import ReassemblyBudget

LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class MeshConfig(EngineConfig):
    """The mesh's settings: the engine's (inherited from EngineConfig, declared there once;
    every worker runs them) and the mesh's own, each declared once with setting()."""

    # The engine's settings whose mesh default differs from the offline engine's
    num_threads: int | None = overridden(EngineConfig, "num_threads", 1)  # workers share cores
    num_ep_ranks: int = overridden(EngineConfig, "num_ep_ranks", 4)
    num_redundant_experts: int = overridden(EngineConfig, "num_redundant_experts", 4)
    # Data plane
    nats_url: str | None = setting(
        None, flag=True, help="use this NATS instead of starting one (a cluster: its servers, "
                              "comma-separated); unset: `evenflow up` starts one on a free port")
    redis_url: str | None = setting(None, flag=True, help="use this Redis instead of starting "
                                                          "one")
    mesh_name: str = setting("default", help="Redis keys are per (model, mesh): meshes can "
                                             "share a Redis")
    # NATS security (services/nats_auth.py)
    nats_auth: bool = setting(True, help="`evenflow up`, starting its own nats-server, creates "
                                         "a NATS user per service with subject permissions")
    nats_credentials_file: str | None = setting(None, help="the credentials a service connects "
                                                           "with")
    nats_tls_ca: str | None = setting(None, help="TLS to NATS: the CA certificate")
    nats_tls_cert: str | None = setting(None, help="TLS to NATS: this service's certificate")
    nats_tls_key: str | None = setting(None, help="TLS to NATS: this service's key")
    # Workers
    engine: str = setting("torch", choices=("torch", "mock"), flag=True,
                          help="mock: a timing model over the real block manager (for routing "
                               "tests)")
    mock_timing_scale: float = setting(1.0, ge=0, help="the mock engine's step times x this "
                                                       "(0: no compute)")
    mock_profile: str = setting("", help="the mock engine's step costs from this roles profile "
                                         "(`evenflow profile-roles` measures the real engine)")
    kv_disk_credit: float = setting(
        0.9, ge=0, le=1, flag=True,
        help="the router's credit for a block on a disk tier, in RAM blocks (a RAM hit is 1, a "
             "recompute 0): 1 - promotion time / recompute time per block, which `evenflow "
             "bench tiers` measures")
    log_level: str = setting("info", choices=LOG_LEVELS, flag=True, help="log level of every "
                                                                         "service")
    served_model_name: str = setting("", flag=True, help="the model name clients send "
                                                         "(default: from --model)")
    stats_log_interval_s: float = setting(10.0, ge=0, help="each engine worker logs a stats "
                                                           "line this often (0: off)")
    debug_step_delay_ms: str = setting(
        "", help="test knob: engine workers sleep this long after every step, a straggler on "
                 "purpose (`evenflow doctor` must name it): MS for every worker, or "
                 "WORKER=MS,...")
    # Gateway
    lora_modules: tuple[str, ...] = setting(
        (), flag=True, help="LoRA adapters to serve, NAME=PATH each (PEFT checkpoints, readable "
                            "where the workers run): a request's \"model\": NAME selects one")
    tool_call_parser: str = setting(
        "", choices=("", "hermes", "llama3_json", "mistral", "deepseek_v3", "openai"),
        flag=True, help="how tool_choice \"auto\" reads the model's own tool-call syntax "
                        "(empty: detected from the chat template; hermes when it names none)")
    reasoning_parser: str = setting(
        "", choices=("", "deepseek_r1", "qwen3", "gpt_oss"), flag=True,
        help="split the model's reasoning into reasoning_content (empty: off)")
    host: str = setting("127.0.0.1", flag=True, help="the gateway's address")
    port: int = setting(8000, ge=0, le=65535, flag=True, help="the gateway's port")
    api_keys: tuple[str, ...] = setting(
        (), help="Bearer keys clients must send, comma-separated (empty: no authentication); "
                 "keys never go on the command line")
    api_key_file: str | None = setting(None, flag=True, help="require a Bearer key: one per "
                                                             "line in this file")
    public_metrics: bool = setting(False, help="with keys set, /metrics and /docs need a key "
                                               "unless this is on")
    max_body_bytes: int = setting(4 * 2**20, ge=1024, help="larger request bodies: 413")
    max_header_bytes: int = setting(64 * 1024, ge=1024, help="larger header sections: 431")
    max_inflight: int = setting(256, ge=1, help="requests running at once at a gateway")
    max_queued: int = setting(512, ge=0, help="requests waiting for a slot; beyond: 429 with "
                                              "Retry-After")
    tenant_header: str = setting("", help="a request header naming its tenant (e.g. set by a "
                                          "proxy in front), over the API key's tenant; empty: "
                                          "tenants come from the API keys only")
    tenant_weights: str = setting("", help="tenants' shares of the admission slots and queue "
                                           "under overload, NAME=WEIGHT,... (others weigh 1)")
    local_prefill_threshold: int = setting(
        128, ge=0, help="a prompt whose part not cached on its decode worker is shorter than "
                        "this many tokens is prefilled there, not shipped (Dynamo's "
                        "max_local_prefill_length; 0: every prompt goes to a prefill worker)")
    kv_index_local_copy: bool = setting(
        True, help="each gateway routes from its own copy of the KV block index, kept from the "
                   "KV-event stream; Redis answers while it is behind (off: Redis only)")
    kv_inline_handoff: bool = setting(
        True, help="K/V that fits in one chunk goes inside the hand-off's completion message; "
                   "off only to measure what it saves")
    decode_retries: int = setting(2, ge=0, le=100, help="other workers tried when one fails or "
                                                        "stops responding")
    queue_timeout_s: float = setting(
        60.0, ge=0, help="a request no live decode worker has KV room for waits this long for "
                         "one, then fails with 503")
    migration_wait_s: float = setting(
        10.0, ge=0, help="a stream whose decode worker died, with no decode worker live at all, "
                         "waits this long for one to come back")
    # Routing
    router: str = setting("kv", choices=("kv", "least_load", "round_robin"), flag=True,
                          help="how the gateway picks workers: kv (cost = w x blocks to prefill "
                               "+ load), least_load or round_robin")
    kv_overlap_weight: float = setting(
        1.0, ge=0, help="w: the cost of one block to prefill against one block of queued work "
                        "(above 1 reuse wins over balance)")
    decode_load_weight: float = setting(4.0, ge=0, help="one running decode sequence, in "
                                                        "blocks")
    load_cap_blocks: float = setting(256.0, gt=0, help="never route to a worker this much "
                                                       "busier than the idlest")
    router_temperature: float = setting(0.0, ge=0, help="> 0: sample workers by "
                                                        "softmax(-cost / T)")
    prediction_ttl_ms: int = setting(2000, ge=0, help="requests just routed count as cached "
                                                      "this long")
    kv_lookup_timeout_s: float = setting(0.05, gt=0, help="Redis slower than this: route by "
                                                          "load alone")
    # Timing
    heartbeat_interval_s: float = setting(0.5, gt=0, help="every service's heartbeat period")
    worker_timeout_s: float = setting(3.0, gt=0, help="a worker silent this long is dead")
    request_timeout_s: float = setting(
        600.0, gt=0, help="a request's deadline (it may ask for less with `timeout`): past it "
                          "the stream ends with a 504 and the workers drop the request")
    stall_timeout_s: float = setting(120.0, gt=0, help="a request with no progress this long "
                                                       "fails (504)")
    drain_timeout_s: float = setting(30.0, ge=0, help="on SIGTERM, a gateway's streams get "
                                                      "this long to finish")
    orphan_ttl_s: float = setting(10.0, gt=0, help="workers drop the requests of a gateway "
                                                   "silent this long")
    kv_transfer_timeout_s: float = setting(10.0, gt=0, help="a K/V hand-off's time limit")
    # KV pulls (services/kv_pull.py): `evenflow bench serve` measures the crossover (pull time
    # against recompute time per token): 26 tokens on the 110M model here, so 32
    kv_pull_min_tokens: int = setting(
        32, ge=0, help="a prefill worker lacking at least this many of a prompt's leading "
                       "tokens which another live worker holds pulls their blocks over NATS "
                       "instead of recomputing them (0: never pull)")
    kv_pull_timeout_s: float = setting(1.0, gt=0, help="a pull taking longer is given up and "
                                                       "the prompt recomputed")
    kv_chunk_bytes: int = setting(512 * 1024, ge=4096, help="K/V chunk size on the bus (below "
                                                            "NATS' 1 MiB max_payload)")
    bus_peer_reassembly_mb: int = setting(64, ge=1, help="incomplete framed bus messages a "
                                                         "process holds per sending peer")
    bus_total_reassembly_mb: int = setting(256, ge=1, help="... and in total")
    # The balancer (MoE models)
    eplb_report_interval_s: float = setting(1.0, gt=0, help="workers report per-slot expert "
                                                            "load this often")
    eplb_threshold: float = setting(0.9, ge=0, le=1, help="rebalance when the windowed rank "
                                                          "balancedness drops below this")
    eplb_min_interval_reports: int = setting(5, ge=1, help="reports between two rebalances, "
                                                           "at least")
    eplb_window_reports: int = setting(10, ge=1, help="reports of load a decision looks at")
    balancer_metrics_port: int = setting(0, ge=0, le=65535, help="> 0: the balancer serves "
                                                                 "Prometheus metrics there")
    metrics_port: int = setting(0, ge=0, le=65535, help="> 0: every worker process serves its "
                                                        "Prometheus /metrics here (`evenflow "
                                                        "up` gives each a free port)")
    metrics_host: str = setting("127.0.0.1", help="where /metrics listens")
    profile_dir: str = setting("", help="with a directory, the gateway serves POST "
                                        "/admin/profile and workers write Chrome traces there")
    eplb_per_role: bool = setting(True, help="a placement per role (prefill, decode); off: one "
                                             "for all")
    direct_stream: bool = setting(True, help="the gateway writes a stream's middle SSE "
                                             "events straight to its socket from the NATS "
                                             "inbox and serves the completions routes past "
                                             "FastAPI's layers (gateway/direct.py, lane.py); "
                                             "off: every event through the request's task "
                                             "and ASGI, every request through FastAPI, for "
                                             "A/B")
    router_sync_interval_s: float = setting(0.05, ge=0, help="each gateway sends the others "
                                                             "its in-flight load and routed "
                                                             "prefixes this often while they "
                                                             "change (gateway/peers.py; 0: "
                                                             "off, heartbeats only)")
    # Fleet (`evenflow up`)
    num_gateways: int = setting(0, ge=0, le=64, flag="--gateways",
                                help="gateway processes sharing the HTTP port (SO_REUSEPORT); "
                                     "0: one per 4 cores, at most 8 and at most twice the "
                                     "engine workers (1 on a 2-core machine)")
    num_prefill: int = setting(1, ge=0, flag="--prefill", help="prefill workers")
    num_decode: int = setting(1, ge=1, flag="--decode", help="decode workers")
    # The planner (evenflow/planner/) and role switching (services/engine_worker.py)
    role_switching: bool = setting(False, help="engine workers may switch between prefill and "
                                               "decode in place when told (RoleSwitch): they "
                                               "listen on both roles' subjects (`up --planner` "
                                               "turns it on)")
    role_switch_drain_s: float = setting(30.0, ge=0, help="a switching worker's streams get "
                                                          "this long to finish; the rest move "
                                                          "to other workers")
    planner: bool = setting(False, flag=True, commands=("up",),
                            help="run the SLA planner: it sizes the prefill and decode pools "
                                 "for --ttft-ms / --itl-ms, by switching workers' roles "
                                 "(or, --planner-mode scale, by starting and stopping them)")
    planner_mode: str = setting("switch", choices=("switch", "restart", "scale", "advisory"),
                                flag=True,
                                help="switch: the planner switches workers' roles in place; "
                                     "restart: the worker drains and exits, and the launcher "
                                     "starts it in the other role; scale: the launcher (or Ray "
                                     "Serve) starts and stops workers to the sizes the planner "
                                     "sends, within --max-workers; advisory: it only logs and "
                                     "exports what it would do")
    max_workers: int = setting(0, ge=0, flag=True,
                               help="--planner-mode scale: at most this many prefill and decode "
                                    "workers in all (0: as many as the mesh starts with); "
                                    "`evenflow up` also keeps a torch engine's workers within "
                                    "the machine's cores")
    ttft_ms: float = setting(2000.0, gt=0, flag=True, help="the planner's TTFT target")
    itl_ms: float = setting(100.0, gt=0, flag=True, help="the planner's ITL target")
    planner_interval_s: float = setting(5.0, gt=0, flag=True,
                                        help="the planner decides this often")
    planner_profile: str = setting("", flag=True,
                                   help="the roles' cost profile `evenflow profile-roles` "
                                        "wrote (JSON); empty: measured online from the "
                                        "workers' heartbeats")
    # DEP (engine/dep/lockstep.py): the launcher sets ep_rank / ep_group per process
    ep_rank: int = setting(0, ge=0, hidden=True, help="this process's rank in its DEP group")
    ep_group: str = setting("", hidden=True, help="this process's DEP group")
    # a Ray Serve replica's DEP ranks: set in their environment rather than by a preexec_fn,
    # whose fork() a replica's gRPC threads do not survive (rayserve/app.py)
    parent_pid: int = setting(0, ge=0, hidden=True,
                              help="end (SIGTERM) when this process ends (0: no such tie)")
    ep_ranks: str = setting("", flag=True, commands=("serve",),
                            help="with --ep N: the ranks of each DEP group this host runs, e.g. "
                                 "0,1 (default: all); the other hosts run the rest with the "
                                 "same --index")
    ep_nodes: int = setting(1, ge=1, flag=True,
                            help="with --ray and --ep N: spread each DEP group over this many "
                                 "nodes (a placement group, N / K ranks on each)")
    # The engine's process-wide switches (engine/config/settings.py ENGINE_SWITCHES), as
    # "NAME=value", from their own variables; every worker gets them.
    engine_switches: tuple[str, ...] = setting((), hidden=True,
                                               help="the engine switches, NAME=value")

    def __post_init__(self) -> None:
        check_settings(self, ConfigError)
        if self.expert_parallel_size > 1 and self.num_ep_ranks != self.expert_parallel_size:
            object.__setattr__(self, "num_ep_ranks", self.expert_parallel_size)
        if self.num_prefill == 0 and self.local_prefill_threshold == 0:
            raise ConfigError("with no prefill workers, local prefill must be enabled")
        try:
            self.tenant_weight_map()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        try:
            self.step_delay_s("")
        except ValueError:
            raise ConfigError("debug_step_delay_ms (EVENFLOW_DEBUG_STEP_DELAY_MS) must be MS or "
                              f"WORKER=MS,..., got {self.debug_step_delay_ms!r}") from None
        try:
            self.check_combinations()
            for name, value in self.switch_values().items():
                check_engine_switch(name, value)
        except KeyError as exc:
            raise ConfigError(f"unknown engine switch {exc.args[0]}") from None
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def tenant_weight_map(self) -> dict[str, float]:
        """tenant_weights (`gold=4,free=1`) as {"gold": 4.0, "free": 1.0}; a ValueError naming
        the entry that is not NAME=WEIGHT with a weight > 0."""
        weights: dict[str, float] = {}
        for item in (part.strip() for part in self.tenant_weights.split(",")):
            if not item:
                continue
            name, sep, value = item.partition("=")
            try:
                weight = float(value)
            except ValueError:
                weight = 0.0
            if not sep or not name.strip() or not weight > 0:
                raise ValueError(f"tenant_weights (EVENFLOW_TENANT_WEIGHTS): {item!r} is not "
                                 "NAME=WEIGHT with a weight > 0")
            weights[name.strip()] = weight
        return weights

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
        """The engine settings every worker runs with (its KV disk tier's own directory given:
        services/engine_worker.py EngineWorker.engine_config)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)}
        return EngineConfig(**values | {"kv_disk_dir": kv_disk_dir})

    def gateway_count(self, cores: int | None = None) -> int:
        """The gateway processes to run: num_gateways, or (0) one per 4 cores, at most 8 and
        at most twice the prefill and decode workers: a gateway per ~4 cores keeps the front
        end off the critical path at a GPU worker's token rate (bench frontend), while on a
        small CPU machine the workers need the cores more."""
        if self.num_gateways:
            return self.num_gateways
        cores = cores or os.cpu_count() or 1
        return max(1, min(cores // 4, 8, 2 * (self.num_prefill + self.num_decode)))

    def fleet_limit(self, cores: int | None = None) -> int:
        """The most prefill and decode workers `--planner-mode scale` may run: max_workers, or
        (0) the mesh's own count; given the machine's `cores` (a mesh on one machine), a torch
        engine's workers also within them (never below the count the mesh starts with)."""
        start = self.num_prefill + self.num_decode
        limit = self.max_workers or start
        if cores and self.engine == "torch":
            limit = min(limit, max(start, cores))
        return max(2, limit)

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
        if raw == "":
            return None  # unset
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
    """Every EVENFLOW_* setting with its default and what it does (the engine's, then the
    mesh's own), then the engine's switches."""
    lines = []
    for title, rows in settings_sections():
        lines.append(f"{title}:")
        for f, s in rows:
            if s.hidden:
                continue
            default = default_of(f)
            shown = ",".join(default) if isinstance(default, tuple) else default
            lines.append(f"  {env_name(f.name)}={'' if shown is None else shown}  {s.help}")
    lines.append("Engine switches (the same offline, under `evenflow up`, Ray Serve and compose):")
    for switch in ENGINE_SWITCHES.values():
        lines.append(f"  {switch.name}={switch.default}  {switch.help}")
    return "\n".join(lines)


def settings_sections() -> list[tuple[str, list]]:
    """The mesh's settings in two groups: the engine's (with the mesh's defaults) and the
    mesh's own (docs/configuration.md, --help-env)."""
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    rows = settings_of(MeshConfig)
    return [("Engine settings (every worker's; `evenflow generate` and the offline LLM take "
             "them as arguments)", [(f, s) for f, s in rows if f.name in engine]),
            ("Mesh settings", [(f, s) for f, s in rows if f.name not in engine])]
