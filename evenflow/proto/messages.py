"""Wire messages of the mesh: small dataclasses, each with a type tag and a version, encoded as
a msgpack envelope {"t": type, "v": version, "d": [fields...]} and decoded through an explicit
registry. A malformed, unknown or oversized message decodes to a `DecodeError` value, never an
exception that could take a service down. Only msgpack crosses the wire.

Who sends what (subjects in `subjects.py`):
  gateway -> prefill worker   PrefillRequest
  gateway -> decode worker    DecodeRequest (local prefill), Cancel
  prefill -> decode worker    KVBlockChunk..., KVTransferComplete
  prefill / decode -> gateway TokenDeltas (one message per step per gateway), ErrorMessage
  every worker -> all         WorkerHeartbeat
  every worker -> kv_index    KVEvents, KVSnapshot;  kv_index -> worker  KVResyncRequest
  every worker -> balancer    ExpertLoad;  balancer -> every worker  ExpertPlacement
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

MAX_MESSAGE_BYTES = 64 * 2**20  # after reassembly of chunks; NATS' own max_payload is smaller


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling settings as they cross the wire (mirrors engine SamplingParams, token-level)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass(frozen=True)
class PrefillRequest:
    TYPE: ClassVar[str] = "prefill_request"
    VERSION: ClassVar[int] = 1
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    reply_subject: str  # where TokenDeltas for this request go (the gateway's inbox)
    decode_worker: str  # the decode worker that continues the request
    enqueued_at: float  # gateway clock, seconds


@dataclass(frozen=True)
class DecodeRequest:
    """Prefill and decode on the decode worker itself (conditional disaggregation)."""

    TYPE: ClassVar[str] = "decode_request"
    VERSION: ClassVar[int] = 1
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec
    reply_subject: str
    enqueued_at: float


@dataclass(frozen=True)
class KVBlockChunk:
    """Raw K/V bytes of some of a request's blocks, block-major: layout (blocks, layers, 2,
    block_size, kv_heads, head_dim) in `dtype`, blocks [first_block, first_block + num_blocks)."""

    TYPE: ClassVar[str] = "kv_chunk"
    VERSION: ClassVar[int] = 1
    request_id: str
    seq: int  # 0, 1, 2, ... per request; gaps and repeats are detected
    first_block: int
    num_blocks: int
    data: bytes


@dataclass(frozen=True)
class KVTransferComplete:
    """All chunks sent: `num_chunks` of them. The decode worker can admit the request."""

    TYPE: ClassVar[str] = "kv_complete"
    VERSION: ClassVar[int] = 1
    request_id: str
    num_chunks: int
    num_blocks: int
    dtype: str
    prompt_token_ids: list[int]
    first_token_id: int
    sampling: SamplingSpec
    reply_subject: str
    num_cached_tokens: int  # prompt tokens the prefill worker found in its prefix cache
    enqueued_at: float
    export_started_at: float  # prefill worker clock when it began exporting this KV


@dataclass(frozen=True)
class TokenDelta:
    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class TokenDeltas:
    """Every delta a worker produced for one gateway in one engine step."""

    TYPE: ClassVar[str] = "token_deltas"
    VERSION: ClassVar[int] = 1
    worker_id: str
    deltas: list[TokenDelta]


@dataclass(frozen=True)
class Cancel:
    TYPE: ClassVar[str] = "cancel"
    VERSION: ClassVar[int] = 1
    request_id: str


@dataclass(frozen=True)
class ErrorMessage:
    """A typed error for one request; it ends that request's stream."""

    TYPE: ClassVar[str] = "error"
    VERSION: ClassVar[int] = 1
    request_id: str
    code: str  # one of proto.errors
    description: str
    retryable: bool = False


STORED, REMOVED, CLEARED = "stored", "removed", "cleared"


@dataclass(frozen=True)
class KVEvent:
    """A change to one worker's prefix cache. `stored`: full blocks newly cached, in chain order,
    the first one's parent being `parent_hash`; `removed`: blocks evicted; `cleared`: all gone."""

    kind: str
    block_hashes: list[int]
    parent_hash: int = 0


@dataclass(frozen=True)
class KVEvents:
    """A worker's cache changes, numbered per (worker, epoch) from 1 without gaps. A new epoch
    means a restarted worker: whatever its old epoch held is gone."""

    TYPE: ClassVar[str] = "kv_events"
    VERSION: ClassVar[int] = 1
    worker_id: str
    role: str
    epoch: str
    seq: int
    events: list[KVEvent]


@dataclass(frozen=True)
class KVResyncRequest:
    """kv_index -> worker: send your whole block set (after a gap, or a Redis restart)."""

    TYPE: ClassVar[str] = "kv_resync_request"
    VERSION: ClassVar[int] = 1
    worker_id: str


@dataclass(frozen=True)
class KVSnapshot:
    """worker -> kv_index: every block hash the worker holds, as of event number `seq`."""

    TYPE: ClassVar[str] = "kv_snapshot"
    VERSION: ClassVar[int] = 1
    worker_id: str
    role: str
    epoch: str
    seq: int
    block_hashes: list[int]


@dataclass(frozen=True)
class ExpertLoad:
    """Tokens per (MoE layer, physical slot) a worker routed since its last report, under the
    placement `version` it runs (so this is also its acknowledgement of that version)."""

    TYPE: ClassVar[str] = "expert_load"
    VERSION: ClassVar[int] = 1
    worker_id: str
    version: int
    num_layers: int
    num_slots: int
    counts: list[int]  # row-major (layers, slots)


@dataclass(frozen=True)
class ExpertPlacement:
    """The balancer's placement, versioned: the logical expert of each (MoE layer, slot), and
    each slot's share of its expert's tokens. Workers apply it between steps."""

    TYPE: ClassVar[str] = "expert_placement"
    VERSION: ClassVar[int] = 1
    version: int
    num_layers: int
    num_slots: int
    phy2log: list[int]  # row-major (layers, slots)
    shares: list[float]  # row-major (layers, slots)


@dataclass(frozen=True)
class WorkerHeartbeat:
    TYPE: ClassVar[str] = "heartbeat"
    VERSION: ClassVar[int] = 2
    worker_id: str
    role: str  # "prefill" | "decode"
    model: str
    running: int
    waiting: int
    free_kv_blocks: int
    total_kv_blocks: int
    queued_prompt_tokens: int
    sent_at: float
    epoch: str = ""  # changes when the worker restarts (its KV index entries go with it)
    kv_bytes_received: int = 0  # decode workers: cumulative KV bytes imported
    kv_transfer_seconds: float = 0.0  # decode: cumulative export start -> transfer complete
    # Each gateway's share of the load above, by its reply subject (decode: requests; prefill:
    # queued prompt tokens), so a gateway can add its own fresher count to the others' share.
    load_by_gateway: dict[str, int] = field(default_factory=dict)


Message = (PrefillRequest | DecodeRequest | KVBlockChunk | KVTransferComplete | TokenDeltas
           | Cancel | ErrorMessage | WorkerHeartbeat | KVEvents | KVResyncRequest | KVSnapshot
           | ExpertLoad | ExpertPlacement)

REGISTRY: dict[str, type] = {cls.TYPE: cls for cls in (
    PrefillRequest, DecodeRequest, KVBlockChunk, KVTransferComplete, TokenDeltas, Cancel,
    ErrorMessage, WorkerHeartbeat, KVEvents, KVResyncRequest, KVSnapshot, ExpertLoad,
    ExpertPlacement)}
_NESTED: dict[tuple[str, str], type] = {
    ("PrefillRequest", "sampling"): SamplingSpec, ("DecodeRequest", "sampling"): SamplingSpec,
    ("KVTransferComplete", "sampling"): SamplingSpec,
}


_NESTED_LISTS: dict[tuple[type, str], type] = {(TokenDeltas, "deltas"): TokenDelta,
                                                 (KVEvents, "events"): KVEvent}


@dataclass(frozen=True)
class DecodeError:
    """Why a payload was rejected; services count these and drop the message."""

    reason: str


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [_to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, list):
        return [_to_wire(v) for v in value]
    return value


def encode(message: Message) -> bytes:
    return msgpack.packb({"t": message.TYPE, "v": message.VERSION, "d": _to_wire(message)},
                         use_bin_type=True)


def _build(cls: type, values: Any) -> Any:
    fields = dataclasses.fields(cls)
    if not isinstance(values, list) or len(values) != len(fields):
        raise TypeError(f"{cls.__name__} wants {len(fields)} fields")
    kwargs = {}
    for f, v in zip(fields, values, strict=True):
        nested = _NESTED.get((cls.__name__, f.name))
        if nested is not None:
            v = _build(nested, v)
        elif (cls, f.name) in _NESTED_LISTS:
            if not isinstance(v, list):
                raise TypeError(f"{f.name} must be a list")
            v = [_build(_NESTED_LISTS[(cls, f.name)], d) for d in v]
        kwargs[f.name] = v
    obj = cls(**kwargs)
    _check_types(obj)
    return obj


_SCALARS = {"str": str, "int": int, "float": (int, float), "bool": bool, "bytes": bytes}


def _check_types(obj: Any) -> None:
    """Shallow type checks from the annotations: a wrong type is a malformed message."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        ann = str(f.type).replace(" ", "")
        optional = ann.endswith("|None")
        base = ann.removesuffix("|None")
        if value is None:
            if not optional:
                raise TypeError(f"{f.name} must not be null")
            continue
        if base in _SCALARS:
            if not isinstance(value, _SCALARS[base]) or (base == "int" and isinstance(value, bool)):
                raise TypeError(f"{f.name} must be {base}")
        elif base == "list[int]":
            if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
                raise TypeError(f"{f.name} must be a list of ints")
        elif base == "dict[str,int]":
            if not isinstance(value, dict) or not all(
                    isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                    for k, v in value.items()):
                raise TypeError(f"{f.name} must map strings to ints")
        elif base == "list[float]":
            if not isinstance(value, list) or not all(isinstance(v, (int, float)) for v in value):
                raise TypeError(f"{f.name} must be a list of numbers")


def decode(payload: bytes) -> Message | DecodeError:
    """Bytes -> message, or a DecodeError saying why not. Never raises."""
    if len(payload) > MAX_MESSAGE_BYTES:
        return DecodeError(f"message of {len(payload)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        envelope = msgpack.unpackb(payload, raw=False, max_bin_len=MAX_MESSAGE_BYTES)
    except Exception as exc:  # msgpack raises several types for garbage
        return DecodeError(f"not msgpack: {type(exc).__name__}")
    if not isinstance(envelope, dict) or not {"t", "v", "d"} <= envelope.keys():
        return DecodeError("not an evenflow envelope")
    cls = REGISTRY.get(envelope["t"]) if isinstance(envelope["t"], str) else None
    if cls is None:
        return DecodeError(f"unknown message type {envelope['t']!r}")
    if envelope["v"] != cls.VERSION:
        return DecodeError(f"{cls.TYPE} version {envelope['v']!r} is not {cls.VERSION}")
    try:
        return _build(cls, envelope["d"])
    except (TypeError, ValueError) as exc:
        return DecodeError(f"malformed {cls.TYPE}: {exc}")
