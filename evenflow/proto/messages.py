"""Wire messages of the mesh: keyword-built frozen dataclasses, each with a type tag and a
version, encoded and decoded by `codec.py` (msgpack, one compiled schema per type). Fields are
only ever appended, with defaults, so neighbouring versions interoperate (see codec.py).

Who sends what (subjects in `subjects.py`):
  gateway -> prefill worker   PrefillRequest, Cancel
  gateway -> decode worker    DecodeRequest (local prefill), Cancel
  prefill -> decode worker    KVBlockChunk..., KVTransferComplete (layout: proto/kv_handoff.py)
  prefill -> holding worker   KVPullRequest;  holder -> prefill  KVBlockChunk..., KVPullDone
  prefill / decode -> gateway TokenDeltas (one message per step per gateway), ErrorMessage
  every service -> all        WorkerHeartbeat
  every worker -> kv_index    KVEvents, KVSnapshot;  kv_index -> worker  KVResyncRequest
  every worker -> balancer    ExpertLoad;  balancer -> every worker  ExpertPlacement
  gateway -> worker           ProfileRequest;  worker -> gateway  ProfileResult
  planner -> worker           RoleSwitch (on the worker's control subject)
  planner -> launcher, workers  FleetTarget (mode `scale`: how many workers each role wants)

KV events follow vLLM's schema (vllm/distributed/kv_events.py): BlockStored, BlockRemoved and
AllBlocksCleared, each packed as `[tag, *fields]` in the same field order, inside a KVEvents
batch. Where they still differ from vLLM's KVEventBatch: the batch carries worker id, role,
epoch and a gap-free sequence number (vLLM numbers batches in its ZMQ envelope and has a
timestamp and data_parallel_rank instead); hashes are our 64-bit chained block hashes
(proto/hashing.py), not vLLM's; the first block of a chain has parent None in both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

from evenflow.proto.codec import MAX_MESSAGE_BYTES, Codec, WireError, lean_init
from evenflow.proto.sampling import SamplingParams

__all__ = ["MAX_MESSAGE_BYTES", "WireError", "encode", "decode"]


class Role(StrEnum):
    """What a service on the bus is. Draining is a state (WorkerHeartbeat.draining), not a role."""

    PREFILL = "prefill"
    DECODE = "decode"
    KV_INDEX = "kv_index"
    BALANCER = "balancer"
    GATEWAY = "gateway"  # heartbeats too, so workers can drop the requests of a dead one
    PLANNER = "planner"  # sizes the prefill and decode pools (evenflow/planner/)


WORKER_ROLES = (Role.PREFILL, Role.DECODE)  # the roles that serve requests and hold KV


@dataclass(frozen=True, kw_only=True)
class PrefillRequest:
    TYPE: ClassVar[str] = "prefill_request"
    VERSION: ClassVar[int] = 2  # 2: sampling is SamplingParams (None, not -1 / [] / "", for unset)
    MIN_VERSION: ClassVar[int] = 2
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_subject: str  # where TokenDeltas for this request go (the gateway's inbox)
    decode_worker: str  # the decode worker that continues the request
    enqueued_at: float  # gateway clock, seconds
    # appended later. Another worker the KV index says holds more of the prompt's leading
    # blocks than this one ("": none): the prefill worker may pull them (KVPullRequest)
    # instead of recomputing them, and how many blocks the index credits it with.
    kv_source: str = ""
    kv_source_blocks: int = 0


@dataclass(frozen=True, kw_only=True)
class DecodeRequest:
    """Prefill and decode on the decode worker itself (conditional disaggregation)."""

    TYPE: ClassVar[str] = "decode_request"
    VERSION: ClassVar[int] = 2  # 2: sampling is SamplingParams
    MIN_VERSION: ClassVar[int] = 2
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    reply_subject: str
    enqueued_at: float


@dataclass(frozen=True, kw_only=True)
class KVBlockChunk:
    """Raw K/V bytes of blocks [first_block, first_block + num_blocks) of one request, in the
    layout proto/kv_handoff.py states."""

    TYPE: ClassVar[str] = "kv_chunk"
    VERSION: ClassVar[int] = 1
    request_id: str
    seq: int  # 0, 1, 2, ... per request; gaps and repeats are detected
    first_block: int
    num_blocks: int
    data: bytes | memoryview  # memoryview on the sending side (no copy until packed)
    # a pull's answer: the pull's nonce (KVPullRequest), which only the asked holder learned
    nonce: str = ""


@dataclass(frozen=True, kw_only=True)
class KVTransferComplete:
    """All chunks sent: `num_chunks` of them. The decode worker can admit the request.

    K/V that fits in one chunk travels inside this message (`inline`: `data`, blocks from
    `first_block`; `num_chunks` 1): the whole hand-off — the prompt, its first token, its K/V
    and the completion — in one message instead of two."""

    TYPE: ClassVar[str] = "kv_complete"
    # 2: inline K/V (inline, data, first_block); 3: SamplingParams; 4: hidden, hidden_dtype
    VERSION: ClassVar[int] = 4
    MIN_VERSION: ClassVar[int] = 3
    request_id: str
    num_chunks: int
    num_blocks: int
    dtype: str
    prompt_token_ids: list[int]
    first_token_id: int
    sampling: SamplingParams
    reply_subject: str
    num_cached_tokens: int  # prompt tokens the prefill worker found in its prefix cache
    enqueued_at: float
    export_started_at: float  # prefill worker clock when it began exporting this KV
    inline: bool = False  # the only chunk's K/V is here, not sent as a chunk:
    data: bytes | memoryview = b""
    first_block: int = 0
    # speculative decoding's mtp: the prompt's last final hidden states (KVPayload.hidden)
    hidden: bytes | memoryview = b""
    hidden_dtype: str = ""


@dataclass(frozen=True, kw_only=True)
class KVPullRequest:
    """A prefill worker asks a worker holding a prompt's leading blocks for blocks
    [first_block, len(prompt_token_ids) / block size) of them (the prompt is cut to whole
    blocks). The holder answers on `reply_subject` with KVBlockChunks (blocks numbered from 0
    = first_block), then KVPullDone; it sends only the run of blocks its cache holds from
    first_block on, possibly none."""

    TYPE: ClassVar[str] = "kv_pull"
    VERSION: ClassVar[int] = 1
    request_id: str
    prompt_token_ids: list[int]
    first_block: int
    reply_subject: str
    # fresh per pull, sent only on the holder's own subject: each answer must carry it, so no
    # other worker (all may publish to the asker's reply subject) can forge one
    nonce: str = ""


@dataclass(frozen=True, kw_only=True)
class KVPullDone:
    """The holder's answer to a KVPullRequest: `num_chunks` chunks carrying `num_blocks`
    blocks from `first_block` on in the hand-off layout (proto/kv_handoff.py); `error` says
    why none were sent, when so."""

    TYPE: ClassVar[str] = "kv_pull_done"
    VERSION: ClassVar[int] = 1
    request_id: str
    num_chunks: int
    num_blocks: int
    first_block: int
    dtype: str
    worker_id: str
    error: str = ""
    nonce: str = ""  # the pull's (KVPullRequest.nonce)


@lean_init  # (built per token per step)
@dataclass(frozen=True, kw_only=True)
class TokenDelta:
    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Position of token_ids[0] in this request's output (the prefill worker's first token is
    # 0), so a gateway sees a delta lost in a NATS outage as a gap; -1: the sender did not say.
    first_index: int = -1
    # When the request asked for logprobs, per token of token_ids: its logprob, and the top-N
    # token ids with their logprobs (compact arrays; the gateway renders them).
    logprobs: list[float] = field(default_factory=list)
    top_logprob_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    # With the first token, when the request asked for prompt logprobs: the same arrays for
    # prompt tokens 1, 2, ... (the first prompt token has none)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprob_ids: list[list[int]] = field(default_factory=list)
    prompt_top_logprobs: list[list[float]] = field(default_factory=list)
    # With the first token, from the worker that computed the prompt: seconds from receiving
    # the request to its engine taking it (queued), and from then to the first token
    # (computed). The gateway splits its time to first token with them (the doctor reads it).
    queued_s: float = 0.0
    computed_s: float = 0.0
    # With the last token, under speculative decoding: the request's draft tokens proposed
    # and accepted (the usage's completion_tokens_details)
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


@dataclass(frozen=True, kw_only=True)
class TokenDeltas:
    """Every delta a worker produced for one gateway in one engine step."""

    TYPE: ClassVar[str] = "token_deltas"
    # 2: TokenDelta.first_index; 3: TokenDelta logprobs; 4: TokenDelta queued_s / computed_s;
    # 5: TokenDelta draft_tokens / accepted_draft_tokens
    VERSION: ClassVar[int] = 5
    worker_id: str
    deltas: list[TokenDelta]


@dataclass(frozen=True, kw_only=True)
class Cancel:
    TYPE: ClassVar[str] = "cancel"
    VERSION: ClassVar[int] = 1
    request_id: str


@dataclass(frozen=True, kw_only=True)
class ErrorMessage:
    """A typed error for one request; it ends that request's stream."""

    TYPE: ClassVar[str] = "error"
    VERSION: ClassVar[int] = 1
    request_id: str
    code: str  # one of proto.errors
    description: str
    retryable: bool = False
    worker_id: str = ""  # the worker that answered ("" : the gateway itself, or an older peer)


# -- KV events (vLLM's schema) --------------------------------------------------------------
# An event's `medium` names the tier: None for the worker's RAM cache, DISK_MEDIUM for its KV
# disk tier (engine/runners/kv_tiers.py).
DISK_MEDIUM = "disk"


@dataclass(frozen=True, kw_only=True)
class BlockStored:
    """Full blocks newly cached, in chain order; the first one's parent is `parent_block_hash`
    (None: the chain's root). `token_ids` are the blocks' tokens, block after block."""

    TAG: ClassVar[str] = "BlockStored"
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int] = field(default_factory=list)
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None


@dataclass(frozen=True, kw_only=True)
class BlockRemoved:
    """Blocks evicted from the cache."""

    TAG: ClassVar[str] = "BlockRemoved"
    block_hashes: list[int]
    medium: str | None = None


@dataclass(frozen=True, kw_only=True)
class AllBlocksCleared:
    """Every block is gone."""

    TAG: ClassVar[str] = "AllBlocksCleared"


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, kw_only=True)
class KVEvents:
    """A worker's cache changes, numbered per (worker, epoch) from 1 without gaps. A new epoch
    means a restarted worker: whatever its old epoch held is gone."""

    TYPE: ClassVar[str] = "kv_events"
    VERSION: ClassVar[int] = 2  # 2: vLLM's event schema
    MIN_VERSION: ClassVar[int] = 2
    worker_id: str
    role: Role
    epoch: str
    seq: int
    events: list[KVCacheEvent]


@dataclass(frozen=True, kw_only=True)
class KVResyncRequest:
    """kv_index -> worker: send your whole block set (after a gap, or a Redis restart)."""

    TYPE: ClassVar[str] = "kv_resync_request"
    VERSION: ClassVar[int] = 1
    worker_id: str


@dataclass(frozen=True, kw_only=True)
class KVSnapshot:
    """worker -> kv_index: every block hash the worker holds in RAM, as of event number `seq`.
    v2: the block hashes its KV disk tier holds (events with medium "disk" keep them current)."""

    TYPE: ClassVar[str] = "kv_snapshot"
    VERSION: ClassVar[int] = 2
    worker_id: str
    role: Role
    epoch: str
    seq: int
    block_hashes: list[int]
    disk_block_hashes: list[int] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class ExpertLoad:
    """Tokens per (MoE layer, physical slot) a worker routed since its last report, under the
    placement `version` it runs (so this is also its acknowledgement of that version).
    v2: the worker's role (placements are per role) and, from an expert-parallel rank (`group`
    names its DEP group), its steps over the same period: their wall time, its own experts'
    compute, the dispatch/combine collectives (which include waiting for the slowest rank) and
    the (token, expert) rows it computed. v3: the rank's place in its group as it runs now (an
    elastic group re-forms with fewer or more ranks) and its host's id (opaque; ranks sharing a
    host share it): the balancer's topology-aware placement reads where load comes from."""

    TYPE: ClassVar[str] = "expert_load"
    VERSION: ClassVar[int] = 3
    worker_id: str
    version: int
    num_layers: int
    num_slots: int
    counts: list[int]  # row-major (layers, slots)
    role: str = ""
    group: str = ""
    steps: int = 0
    step_s: float = 0.0
    moe_compute_s: float = 0.0
    moe_wait_s: float = 0.0
    moe_rows: int = 0
    ep_rank: int = -1
    ep_size: int = 0
    host: str = ""


@dataclass(frozen=True, kw_only=True)
class ExpertPlacement:
    """The balancer's placement, versioned: the logical expert of each (MoE layer, slot), and
    each slot's share of its expert's tokens. Workers apply it between steps. v2: `role`, the
    workers it is for (prefill and decode load differ); "" for every role."""

    TYPE: ClassVar[str] = "expert_placement"
    VERSION: ClassVar[int] = 2
    version: int
    num_layers: int
    num_slots: int
    phy2log: list[int]  # row-major (layers, slots)
    shares: list[float]  # row-major (layers, slots)
    role: str = ""


@dataclass(frozen=True, kw_only=True)
class WorkerHeartbeat:
    """Every service's liveness and load, every heartbeat interval."""

    TYPE: ClassVar[str] = "heartbeat"
    # 3: `draining` is its own field (was folded into role); 4: the engine's cumulative step
    # time and tokens (an operator's tools compare workers from them, no tracing needed); 5:
    # what an engine worker runs (weights, KV cache dtype, kernels), for /v1/models; 6: role
    # switches (the role it drains to switch to, how many it made); 7: numerics; 8: reconnects
    VERSION: ClassVar[int] = 8
    worker_id: str
    role: Role
    model: str
    running: int = 0
    waiting: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    queued_prompt_tokens: int = 0
    sent_at: float = 0.0
    epoch: str = ""  # changes when the worker restarts (its KV index entries go with it)
    kv_bytes_received: int = 0  # decode workers: cumulative KV bytes imported
    kv_transfer_seconds: float = 0.0  # decode: cumulative export start -> transfer complete
    # Each gateway's share of the load above, by its reply subject (decode: requests; prefill:
    # queued prompt tokens), so a gateway can add its own fresher count to the others' share.
    load_by_gateway: dict[str, int] = field(default_factory=dict)
    draining: bool = False  # shutting down: route nothing new here (its KV lease holds)
    unhealthy: str = ""  # why it cannot serve now (its engine keeps failing); empty: healthy
    metrics_port: int = 0  # where this process serves Prometheus /metrics (0: nowhere)
    # engine workers: cumulative wall time of engine steps, back-to-back steps' gaps included
    step_seconds: float = 0.0
    prompt_tokens_computed: int = 0  # cumulative prompt tokens computed (cached ones not)
    output_tokens: int = 0  # cumulative tokens generated
    # finished requests' first-to-last-token time and those tokens: time per output token as
    # the streams saw it
    stream_seconds: float = 0.0
    stream_tokens: int = 0
    # engine workers: what runs (ServingEngine.serving_form); changes once where the native
    # kernels were built after the worker started
    weights: str = ""  # e.g. "int4-g32 W4A8 (bf16 rest)", "MXFP4 experts (bf16 rest)"
    kv_cache_dtype: str = ""  # bf16, int8, ...
    kernels: str = ""  # which native kernels serve, and which are torch's
    # "deterministic float32" where the engine is batch-invariant, else empty: a stream moved
    # off such a worker goes to one of the same numerics where one is live (identical text)
    numerics: str = ""
    # engine workers that may switch role (planner/): the role it drains to switch to (empty:
    # none under way), and the switches it made since it started
    switching_to: str = ""
    role_switches: int = 0
    requests_finished: int = 0  # engine workers: cumulative requests finished here
    # times this process's NATS connection came back: what was sent to it meanwhile is lost
    # (the gateway sends its silent requests again)
    reconnects: int = 0


# -- operator profiles (POST /admin/profile at the gateway) ------------------------------------
@dataclass(frozen=True, kw_only=True)
class ProfileRequest:
    """Gateway -> one worker (on its request subject): run torch.profiler over its next
    `steps` engine steps (at most timeout_s), then answer with a ProfileResult."""

    TYPE: ClassVar[str] = "profile_request"
    VERSION: ClassVar[int] = 1
    request_id: str
    steps: int
    timeout_s: float
    reply_subject: str


@dataclass(frozen=True, kw_only=True)
class ProfileResult:
    """Worker -> the gateway that asked: the operator table (text lines, as `evenflow profile`
    prints them) and where the worker wrote the Chrome/Perfetto trace."""

    TYPE: ClassVar[str] = "profile_result"
    VERSION: ClassVar[int] = 1
    request_id: str
    worker_id: str
    steps: int  # steps profiled (fewer than asked when the timeout came first)
    lines: list[str] = field(default_factory=list)
    trace_file: str = ""
    error: str = ""


@dataclass(frozen=True, kw_only=True)
class RoutedPrefix:
    """A prompt's block hashes a gateway just sent to a worker (it will hold them)."""

    worker_id: str
    block_hashes: list[int]


@dataclass(frozen=True, kw_only=True)
class RouterSync:
    """A gateway's routing state, for the other gateways (as Dynamo's router replicas sync):
    its in-flight load on each worker, whole, and the prefixes it routed since its last
    sync. Sent every router_sync_interval_s while it changes."""

    TYPE: ClassVar[str] = "router_sync"
    VERSION: ClassVar[int] = 1
    gateway_id: str  # its inbox subject, as workers' heartbeats name it in load_by_gateway
    inflight: dict[str, int]  # worker_id -> its requests there, not finished
    inflight_blocks: dict[str, int]  # worker_id -> prompt blocks they still have to prefill
    routed: list[RoutedPrefix] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class RoleSwitch:
    """Planner (or an operator) -> one engine worker, on its control subject: drain (streams
    finish within drain_s, the rest move to other workers) and serve `to_role` from the same
    process, engine and weights (services/engine_worker.py)."""

    TYPE: ClassVar[str] = "role_switch"
    VERSION: ClassVar[int] = 1
    worker_id: str
    to_role: str  # "prefill" or "decode"
    drain_s: float = 30.0
    reason: str = ""  # the planner's words, for the worker's log line
    # False: drain, then exit for the launcher to start it again in `to_role` (what a fleet
    # without in-place switching does; `evenflow bench planner` compares the two)
    in_place: bool = True


@dataclass(frozen=True, kw_only=True)
class FleetTarget:
    """Planner (mode `scale`) -> whoever sizes the fleet, every decision: how many workers
    each role should have. `evenflow up`'s launcher starts or stops workers to match; on Ray
    Serve the engine replicas report it and the deployments' autoscaling policies follow it
    (rayserve/autoscaling.py). Sent each interval, so a listener that starts late learns it
    at once; `retire` names the workers to stop first where a role shrinks (least to drain)."""

    TYPE: ClassVar[str] = "fleet_target"
    VERSION: ClassVar[int] = 1
    planner_id: str
    prefill: int
    decode: int
    retire: list[str] = field(default_factory=list)
    reason: str = ""


Message = (PrefillRequest | DecodeRequest | KVBlockChunk | KVTransferComplete | TokenDeltas
           | Cancel | ErrorMessage | WorkerHeartbeat | KVEvents | KVResyncRequest | KVSnapshot
           | ExpertLoad | ExpertPlacement | ProfileRequest | ProfileResult | KVPullRequest
           | KVPullDone | RouterSync | RoleSwitch | FleetTarget)

CODEC = Codec((PrefillRequest, DecodeRequest, KVBlockChunk, KVTransferComplete, TokenDeltas,
               Cancel, ErrorMessage, WorkerHeartbeat, KVEvents, KVResyncRequest, KVSnapshot,
               ExpertLoad, ExpertPlacement, ProfileRequest, ProfileResult, KVPullRequest,
               KVPullDone, RouterSync, RoleSwitch, FleetTarget))
REGISTRY = CODEC.registry


def encode(message: Message) -> bytes:
    return CODEC.encode(message)


def decode(payload: bytes) -> Message | WireError:
    """Bytes -> message, or a WireError saying why not. Never raises."""
    result: Message | WireError = CODEC.decode(payload)
    return result
