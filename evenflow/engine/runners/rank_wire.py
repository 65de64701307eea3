"""What crosses the process group between the rank processes of one engine, as typed messages
(frozen dataclasses through the mesh's codec, proto/codec.py: a {type, version} envelope,
fields checked on decode), never positional lists:

- a tensor-parallel leader's commands to its followers (InitRunner, RunForward, ReadKV,
  WriteKV, Placement, Stop): two broadcasts, a header int64[payload bytes], then the encoded
  bytes; followers wait for the header patiently (no timeout while rank 0 lives, sleeping once
  idle);
- the mail expert-parallel ranks exchange at their per-step meeting (engine/dep/lockstep.py):
  a `Meeting` from every rank, gathered by all_gather (lengths, then the bytes padded to the
  longest) — offline, rank 0's carries the other ranks' new requests, aborts, placements and
  stop, and the others' carry their last step's outputs; in the mesh it is empty and never
  sent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from evenflow.engine.runners.model_runner import ChunkInput
from evenflow.parallel.group import ProcessGroup
from evenflow.proto.codec import Codec, WireError
from evenflow.proto.sampling import SamplingParams, TokenLogprobs

LOAD_TIMEOUT_S = 600.0  # every rank of a group started, joined and loaded its weights
STEP_TIMEOUT_S = 60.0  # any one collective once serving


# -- tensor parallelism: the leader's runner -> its followers' runners -------------------------
@dataclass(frozen=True, kw_only=True)
class InitRunner:
    TYPE: ClassVar[str] = "rank.init_runner"
    VERSION: ClassVar[int] = 1
    num_blocks: int
    block_size: int
    max_model_len: int
    window_blocks: int = 0  # the sliding-window layers' own pool (0: none)


@dataclass(frozen=True, kw_only=True)
class RunForward:
    TYPE: ClassVar[str] = "rank.run_forward"
    VERSION: ClassVar[int] = 1
    chunks: list[ChunkInput]


@dataclass(frozen=True, kw_only=True)
class ReadKV:
    """Every rank contributes its heads of these blocks to an all_gather."""

    TYPE: ClassVar[str] = "rank.read_kv"
    VERSION: ClassVar[int] = 1
    block_ids: list[int]
    window_ids: list[int] | None = None  # the same blocks in the sliding layers' table


@dataclass(frozen=True, kw_only=True)
class WriteKV:
    """The full-head payload of this shape follows as one broadcast; each rank keeps its heads."""

    TYPE: ClassVar[str] = "rank.write_kv"
    VERSION: ClassVar[int] = 1
    block_ids: list[int]
    shape: list[int]
    window_ids: list[int] | None = None


# -- both ---------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Placement:
    """An expert placement: phy2log (and shares) row-major over `shape` (MoE layers, slots)."""

    TYPE: ClassVar[str] = "rank.placement"
    VERSION: ClassVar[int] = 1
    shape: list[int]
    phy2log: list[int]
    share: list[float] | None = None  # None: even shares among an expert's replicas
    num_ep_ranks: int = 0
    version: int = 0

    @classmethod
    def of(cls, phy2log: torch.Tensor, share: torch.Tensor | None, num_ep_ranks: int = 0,
           version: int = 0) -> Placement:
        return cls(shape=list(phy2log.shape), phy2log=phy2log.flatten().tolist(),
                   share=None if share is None else share.flatten().tolist(),
                   num_ep_ranks=num_ep_ranks, version=version)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        share = None if self.share is None else \
            torch.tensor(self.share, dtype=torch.float32).view(self.shape)
        return torch.tensor(self.phy2log).view(self.shape), share


@dataclass(frozen=True, kw_only=True)
class Stop:
    TYPE: ClassVar[str] = "rank.stop"
    VERSION: ClassVar[int] = 1


# -- expert parallelism (engine/dep/): every rank's mail at the group's per-step meeting -------
@dataclass(frozen=True, kw_only=True)
class RankAdd:
    rank: int  # the rank whose engine takes the request
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams


@dataclass(frozen=True, kw_only=True)
class RankOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str = ""  # FinishReason's value; "" while running
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    refused: str = ""  # the rank refused the request (its ValueError): no tokens


@dataclass(frozen=True, kw_only=True)
class RankStepDone:
    """One rank's step: its outputs, its MoE timing [compute s, collective s incl. waiting,
    rows], and how long it paused before the step to switch a placement's layer."""

    outputs: list[RankOutput]
    moe: list[float]
    pause_s: float


@dataclass(frozen=True, kw_only=True)
class Meeting:
    TYPE: ClassVar[str] = "rank.meeting"
    VERSION: ClassVar[int] = 1
    adds: list[RankAdd] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)  # every rank aborts these ids it holds
    placement: Placement | None = None  # every rank takes it (agreed as the mesh's are)
    take_load: bool = False  # after this meeting every rank all-reduces its slot counts
    stop: bool = False
    done: RankStepDone | None = None  # the sender's last step, for rank 0 (offline)


RankMessage = InitRunner | RunForward | ReadKV | WriteKV | Placement | Stop | Meeting
CODEC = Codec((InitRunner, RunForward, ReadKV, WriteKV, Placement, Stop, Meeting))


def _decoded(data: bytes) -> RankMessage:
    message = CODEC.decode(data)
    if isinstance(message, WireError):  # ranks run the same code: this is a bug, not input
        raise RuntimeError(f"rank wire: {message.reason}")
    return message


def send_command(group: ProcessGroup, command: RankMessage) -> None:
    data = CODEC.encode(command)
    group.broadcast(torch.tensor([len(data)], dtype=torch.int64))
    group.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def receive_command(group: ProcessGroup) -> RankMessage:
    header = group.broadcast(torch.zeros(1, dtype=torch.int64), patient=True)
    data = group.broadcast(torch.empty(int(header.item()), dtype=torch.uint8))
    return _decoded(data.numpy().tobytes())


def encode(message: RankMessage) -> bytes:
    return CODEC.encode(message)


def gather_meetings(group: ProcessGroup, data: bytes, sizes: list[int]) -> list[Meeting | None]:
    """Every rank's encoded Meeting (None where its size is 0), by rank, on every rank; `sizes`
    came from an earlier all_gather that every rank made."""
    mine = torch.zeros(max(sizes), dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    every = group.all_gather(mine)
    meetings: list[Meeting | None] = []
    for r, size in enumerate(sizes):
        message = _decoded(every[r, :size].numpy().tobytes()) if size else None
        if message is not None and not isinstance(message, Meeting):
            raise RuntimeError(f"rank wire: rank {r} sent {type(message).__name__} to a meeting")
        meetings.append(message)
    return meetings


def stop_ranks(procs: list[Any], group: ProcessGroup | None,
               say_stop: Callable[[], Any] | None = None) -> None:
    """Tell the ranks to stop (if they can all hear it: by `say_stop`, else a Stop command),
    then make sure they are gone, and close the group."""
    if group is not None and all(p.exitcode is None for p in procs):
        try:
            group.timeout_s = 2.0  # type: ignore[attr-defined]
            if say_stop is not None:
                say_stop()
            else:
                send_command(group, Stop())
        except Exception:  # gone or stuck: killed below
            pass
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    if group is not None:
        group.close()
