"""The values an engine hands its worker across the serving seam (services/engine_api.py),
named fields rather than positional tuples; torch-free, so that the engine, which makes them,
and the services, which read them, share one definition."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServingForm:
    """What runs, for heartbeats and /v1/models: e.g. weights "int4-g32 W4A8 (bf16 rest)",
    KV cache "int8", kernels "native kernels (-march=native): norm, rotary, ..."."""

    weights: str = ""
    kv_cache: str = ""
    kernels: str = ""
    # "deterministic <dtype>" where the engine is batch-invariant (a stream's text does not
    # depend on its batch), else empty: a stream moved off such a worker continues identically
    # only on a worker with the same numerics
    numerics: str = ""


@dataclass(frozen=True)
class ExpertLoadCounts:
    """Tokens routed to each (MoE layer, physical slot) since the last take, row-major."""

    num_layers: int
    num_slots: int
    counts: list[int]


@dataclass(frozen=True)
class RankTiming:
    """An expert-parallel rank's steps since the last take: how many, their time, and in them
    the MoE layers' own compute, their collectives (waiting for the slowest rank included) and
    the (token, expert) rows computed."""

    steps: int = 0
    step_s: float = 0.0
    moe_compute_s: float = 0.0
    moe_wait_s: float = 0.0
    rows: int = 0


@dataclass(frozen=True)
class EPTopology:
    """An expert-parallel rank's place: its rank in its group, the group's size, its host."""

    rank: int = -1
    group_size: int = 0
    host: str = ""
