"""Mesh configuration: one frozen dataclass, built once at the edge from `EVENFLOW_*`
environment variables and CLI overrides. This is the only module that reads the environment
(besides OpenTelemetry's own OTEL_* variables). An unknown EVENFLOW_ key is an error."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "EVENFLOW_"


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class MeshConfig:
    # Data plane; None means `evenflow up` starts a local server on a free port.
    nats_url: str | None = None
    redis_url: str | None = None
    # Model and engine (every worker uses the same)
    model: str = "tiny-moe"
    engine: str = "torch"  # "torch", or "mock": a timing model over the real block manager
    dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_gb: float = 0.5
    num_kv_blocks: int = 0  # 0: derived from kv_cache_gb
    threads_per_worker: int = 1
    # Gateway
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    # Conditional disaggregation (as Dynamo's max_local_prefill_length): a prompt whose part not
    # cached on its decode worker is shorter than this many tokens is prefilled there, not
    # shipped; a chat's next turn thus reuses the previous answer, which only the decode worker
    # holds. 0 disables (every prompt goes to a prefill worker).
    local_prefill_threshold: int = 128
    decode_retries: int = 2  # other decode workers tried when one has no room
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
    request_timeout_s: float = 120.0  # a request with no progress this long fails
    kv_transfer_timeout_s: float = 10.0
    kv_chunk_bytes: int = 512 * 1024  # below NATS' default 1 MiB max_payload
    # Expert parallelism and the balancer (MoE models; virtual EP ranks inside each worker)
    num_ep_ranks: int = 4  # 0: no expert placement, no balancer
    num_redundant_experts: int = 4  # extra slots for replicas of hot experts
    eplb_report_interval_s: float = 1.0  # workers report per-slot load this often
    eplb_threshold: float = 0.9  # rebalance when windowed rank balancedness drops below
    eplb_min_interval_reports: int = 5  # reports between two rebalances, at least
    eplb_window_reports: int = 10  # reports of load a decision looks at
    balancer_metrics_port: int = 0  # > 0: the balancer serves Prometheus metrics there
    # Fleet (for `evenflow up`)
    num_prefill: int = 1
    num_decode: int = 1

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.port < 0 or self.local_prefill_threshold < 0:
            raise ConfigError("block_size >= 1, port >= 0 and local_prefill_threshold >= 0")
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ConfigError("the mesh needs at least one decode worker")
        if self.num_prefill == 0 and self.local_prefill_threshold == 0:
            raise ConfigError("with no prefill workers, local prefill must be enabled")
        if self.router not in ("kv", "least_load", "round_robin"):
            raise ConfigError(f"router must be kv, least_load or round_robin, got {self.router!r}")
        if self.engine not in ("torch", "mock"):
            raise ConfigError(f"engine must be torch or mock, got {self.engine!r}")
        if self.kv_chunk_bytes < 4096:
            raise ConfigError("kv_chunk_bytes must be at least 4096")

    @property
    def model_name(self) -> str:
        """The name clients use in the `model` field: the built-in name or the directory's."""
        return os.path.basename(self.model.rstrip("/")) or self.model

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the engine's EngineConfig (services never import the engine)."""
        return dict(model=self.model, dtype=self.dtype, block_size=self.block_size,
                    max_num_seqs=self.max_num_seqs,
                    max_num_batched_tokens=self.max_num_batched_tokens,
                    kv_cache_gb=self.kv_cache_gb, num_kv_blocks=self.num_kv_blocks or None,
                    num_threads=self.threads_per_worker, num_ep_ranks=self.num_ep_ranks,
                    num_redundant_experts=self.num_redundant_experts)

    def to_env(self) -> dict[str, str]:
        """EVENFLOW_* variables that rebuild this config in a child process."""
        env = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            env[ENV_PREFIX + f.name.upper()] = (
                ",".join(value) if isinstance(value, tuple) else str(value))
        return env


def _coerce(name: str, annotation: str, raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    base = annotation.replace(" ", "").removesuffix("|None")
    try:
        if base == "int":
            return int(raw)
        if base == "float":
            return float(raw)
        if base == "bool":
            return raw.lower() in ("1", "true", "yes", "on")
        if base.startswith("tuple"):
            return tuple(x for x in raw.split(",") if x)
    except ValueError as exc:
        raise ConfigError(f"{name}: cannot parse {raw!r} as {base}") from exc
    return raw


def load_config(overrides: Mapping[str, Any] | None = None,
                environ: Mapping[str, str] | None = None) -> MeshConfig:
    """Environment first, then overrides (CLI flags); None values in overrides are skipped."""
    environ = os.environ if environ is None else environ
    fields = {f.name: str(f.type) for f in dataclasses.fields(MeshConfig)}
    values: dict[str, Any] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX):].lower()
        if name not in fields:
            raise ConfigError(f"unknown setting {key}; known: "
                              + ", ".join(ENV_PREFIX + n.upper() for n in fields))
        values[name] = _coerce(key, fields[name], raw)
    for name, value in (overrides or {}).items():
        if name not in fields:
            raise ConfigError(f"unknown setting {name!r}")
        if value is not None:
            values[name] = _coerce(name, fields[name], value)
    return MeshConfig(**values)
