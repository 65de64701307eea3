"""The engine as a service sees it: exactly what prefill and decode workers may ask of a model
engine, torch-free. `evenflow.engine.Engine` and the mock engine implement it; services hold an
engine only as a `ServingEngine` and never touch its internals (tests/unit/test_import_rules.py
enforces that services name no other engine member).

Threading: every method but the read-only counters runs on the engine thread
(services/engine_thread.py), between steps. The counters (num_running, num_waiting,
num_free_kv_blocks) may be read from the event loop for heartbeats: they are plain ints, a
step's worth stale at most; so may cached_prefix_blocks (dict lookups).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from evenflow.proto.engine_values import EPTopology, ExpertLoadCounts, RankTiming, ServingForm
from evenflow.proto.kv_handoff import KVPayload
from evenflow.proto.messages import KVCacheEvent
from evenflow.proto.sampling import SamplingParams, TokenLogprobs


class FinishReasonLike(Protocol):
    @property
    def value(self) -> str: ...


class EngineOutput(Protocol):
    """One request's result of one step."""

    @property
    def request_id(self) -> str: ...
    @property
    def new_token_ids(self) -> list[int]: ...
    @property
    def finished(self) -> bool: ...
    @property
    def finish_reason(self) -> FinishReasonLike | None: ...  # .value: stop | length | abort
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_cached_tokens(self) -> int: ...
    @property
    def logprobs(self) -> TokenLogprobs | None: ...
    @property
    def prompt_logprobs(self) -> list[TokenLogprobs] | None: ...
    @property
    def kv(self) -> KVPayload | None: ...  # export_kv: the prompt's K/V, a step after the token
    @property
    def kv_follows(self) -> bool: ...  # export_kv: this finishing output's K/V comes next step
    @property
    def draft_tokens(self) -> int: ...  # speculative decoding, with the last token: proposed
    @property
    def accepted_draft_tokens(self) -> int: ...  # ... and accepted, for the request's usage


class KVDiskCounts(Protocol):
    """A KV disk tier's counts since its engine started (plain ints the engine thread bumps:
    a read from the event loop is a step stale at most), in blocks; misses in lookups, by reason
    (a fixed set of keys)."""

    @property
    def hits(self) -> int: ...  # found there by a prefix lookup or a KV pull
    @property
    def promotions(self) -> int: ...  # read back into RAM
    @property
    def writes(self) -> int: ...  # written down (blocks evicted from RAM)
    @property
    def evictions(self) -> int: ...  # dropped by the tier to make room
    @property
    def misses(self) -> Mapping[str, int]: ...  # lookups it could not serve, by reason


class SpecCounts(Protocol):
    """Speculative decoding's counts since the engine started (plain ints the engine thread
    bumps; engine/serving/speculation.py)."""

    @property
    def drafts(self) -> int: ...  # verification steps
    @property
    def draft_tokens(self) -> int: ...
    @property
    def accepted_tokens(self) -> int: ...
    @property
    def accepted_per_position(self) -> Sequence[int]: ...


class EngineLayout(Protocol):
    """The engine's sizes, fixed at construction."""

    @property
    def max_model_len(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_kv_blocks(self) -> int: ...
    @property
    def kv_block_shape(self) -> tuple[int, ...]: ...  # one block, hand-off layout
    @property
    def kv_dtype_name(self) -> str: ...
    def blocks_needed(self, num_tokens: int) -> int: ...


class PrefixCachePort(Protocol):
    """The prefix cache (engine thread, but for the reads marked loop-safe)."""

    def take_kv_events(self) -> list[KVCacheEvent]: ...
    def cached_block_hashes(self) -> list[int]: ...
    def disk_block_hashes(self) -> list[int]: ...
    @property
    def disk_counts(self) -> KVDiskCounts | None:
        """The KV disk tier's counts (None: no disk tier); a read the event loop may make."""
    def cached_prefix_blocks(self, token_ids: list[int]) -> int:
        """How many of the prompt's leading blocks the RAM cache holds: a read the event loop
        may make too (a step stale at most)."""
    def export_prefix(self, token_ids: list[int], first_block: int) -> KVPayload:
        """The full blocks of token_ids from first_block on, as far as this engine holds them
        in RAM or on its disk tier (a KV pull's holder side)."""
    def import_prefix(self, token_ids: list[int], first_block: int, kv: KVPayload) -> int:
        """Pulled blocks into the prefix cache; how many were written. KVHandoffError (a
        ValueError) when they do not fit."""


class PlacementPort(Protocol):
    """Expert placement (engine thread)."""

    @property
    def active(self) -> bool: ...  # the engine runs MoE layers under a placement
    @property
    def version(self) -> int: ...
    def apply_expert_placement(self, version: int, phy2log: list[int],
                               shares: list[float]) -> None: ...
    def take_expert_load(self) -> ExpertLoadCounts:
        """Token counts per (MoE layer, slot) since the last call."""
    def take_rank_timing(self) -> RankTiming | None:
        """An expert-parallel rank's steps and MoE times since the last call; None
        elsewhere."""
    def ep_topology(self) -> EPTopology | None:
        """An expert-parallel rank's place in its group; None elsewhere."""


class ProfilePort(Protocol):
    """Operator profiles (engine thread)."""

    def start(self) -> None:
        """Profile the steps from now on (torch.profiler)."""
    def stop(self, steps: int, trace_file: str = "") -> list[str]:
        """Stop; the operator table over those steps as text lines (trace written if asked)."""


class KernelsPort(Protocol):
    """Which kernels run, and the switch onto the native ones built after the start."""

    def summary(self) -> str:
        """Which kernels this engine runs (native or torch, and the switch that chose), for
        the worker's ready line."""
    def serving_form(self) -> ServingForm:
        """Weight form, KV cache dtype and kernels: heartbeats carry it to /v1/models."""
    @property
    def pending(self) -> bool:
        """Serving on torch's kernels while the native ones build elsewhere (a machine's first
        start): the engine thread then calls switch_when_ready while idle."""
    def switch_when_ready(self) -> str | None:
        """Called while idle: reload onto the native kernels once built. The new kernel summary
        when it switched, else None."""


class ServingEngine(Protocol):
    """The core a worker drives, and one port per part the engine holds."""

    @property
    def layout(self) -> EngineLayout: ...

    # -- load (read from the event loop) -------------------------------------------------------
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_free_kv_blocks(self) -> int: ...
    @property
    def spec_counts(self) -> SpecCounts | None: ...  # None: no speculative decoding

    # -- requests (engine thread) --------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    export_kv: bool = False) -> None:
        """Queue a request; ValueError naming the problem if it cannot be served."""

    def add_prefilled_request(self, request_id: str, prompt_token_ids: list[int],
                              first_token_id: int, params: SamplingParams, kv: KVPayload,
                              num_cached_tokens: int = 0) -> None:
        """Continue a request another engine prefilled; ValueError (KVHandoffError) if not."""

    def abort(self, request_id: str) -> bool: ...
    def abort_all(self) -> list[str]:
        """Drop every request after a failed step; their ids (no outputs follow)."""
    def has_unfinished(self) -> bool: ...  # a read: no side effects
    def decide_step(self) -> bool:
        """Whether to step now: asked exactly once per loop of the engine thread (for an
        expert-parallel rank a collective with its group, where a placement every rank holds
        advances by one MoE layer)."""
    def step(self) -> Sequence[EngineOutput]: ...
    def configure_current_thread(self) -> None: ...
    @property
    def idle_poll_s(self) -> float:
        """How long the engine thread may wait for commands when idle."""
    @property
    def fatal_error(self) -> str | None:
        """Set when the engine can never step again (a tensor-parallel rank is gone)."""
    @property
    def restart_planned(self) -> bool:
        """With fatal_error set: a restart is the plan, not a crash (an elastic
        expert-parallel group re-forming)."""

    # -- the parts ----------------------------------------------------------------------------
    @property
    def prefix(self) -> PrefixCachePort: ...
    @property
    def placement(self) -> PlacementPort: ...
    @property
    def profile(self) -> ProfilePort: ...
    @property
    def kernels(self) -> KernelsPort: ...


def logprob_fields(out: EngineOutput) -> dict[str, Any]:
    """One output's logprobs (and the prompt's, with the first token) as TokenDelta's fields
    (none if absent)."""
    fields: dict[str, Any] = {}
    if out.logprobs is not None:
        chosen, ids, values = out.logprobs.logprob, out.logprobs.top_ids, out.logprobs.top_logprobs
        fields |= {"logprobs": [chosen], "top_logprob_ids": [list(ids)],
                   "top_logprobs": [list(values)]}
    if out.prompt_logprobs is not None:
        fields |= {"prompt_logprobs": [p.logprob for p in out.prompt_logprobs],
                   "prompt_top_logprob_ids": [list(p.top_ids) for p in out.prompt_logprobs],
                   "prompt_top_logprobs": [list(p.top_logprobs) for p in out.prompt_logprobs]}
    return fields
