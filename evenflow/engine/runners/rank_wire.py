"""The typed commands a rank-0 process sends the rank processes it started (tensor-parallel
followers, offline expert-parallel ranks), and the replies it gathers from them: frozen
dataclasses through the mesh's codec (proto/codec.py: a {type, version} envelope, fields
checked on decode), never positional lists.

On the process group a command is two broadcasts: a header int64[payload bytes], then the
encoded bytes; receivers wait for the header patiently (no timeout while rank 0 lives, sleeping
once idle). Replies are gathered by all_gather: their lengths, then the bytes padded to the
longest. And how ranks are stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from evenflow.engine.runners.model_runner import ChunkInput
from evenflow.parallel.group import ProcessGroup
from evenflow.proto.codec import Codec, WireError
from evenflow.proto.messages import SamplingSpec

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


@dataclass(frozen=True, kw_only=True)
class WriteKV:
    """The full-head payload of this shape follows as one broadcast; each rank keeps its heads."""

    TYPE: ClassVar[str] = "rank.write_kv"
    VERSION: ClassVar[int] = 1
    block_ids: list[int]
    shape: list[int]


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


# -- offline expert parallelism (engine/dep/offline.py): rank 0 -> every rank, and back -------
@dataclass(frozen=True, kw_only=True)
class RankAdd:
    rank: int  # the rank whose engine takes the request
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingSpec


@dataclass(frozen=True, kw_only=True)
class StepRanks:
    TYPE: ClassVar[str] = "rank.step"
    VERSION: ClassVar[int] = 1
    adds: list[RankAdd]
    aborts: list[str]


@dataclass(frozen=True, kw_only=True)
class TakeLoad:
    """Every rank all-reduces its per-slot token counts."""

    TYPE: ClassVar[str] = "rank.take_load"
    VERSION: ClassVar[int] = 1


@dataclass(frozen=True, kw_only=True)
class TokenLogprobs:
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


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

    TYPE: ClassVar[str] = "rank.step_done"
    VERSION: ClassVar[int] = 1
    outputs: list[RankOutput]
    moe: list[float]
    pause_s: float


RankMessage = (InitRunner | RunForward | ReadKV | WriteKV | Placement | Stop | StepRanks
               | TakeLoad | RankStepDone)
CODEC = Codec((InitRunner, RunForward, ReadKV, WriteKV, Placement, Stop, StepRanks, TakeLoad,
               RankStepDone))


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


def gather(group: ProcessGroup, message: RankMessage) -> list[RankMessage]:
    """Every rank's message, by rank, on every rank."""
    data = CODEC.encode(message)
    sizes = group.all_gather(torch.tensor([len(data)], dtype=torch.int64)).view(-1)
    mine = torch.zeros(int(sizes.max()), dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    every = group.all_gather(mine)
    return [_decoded(every[r, :size].numpy().tobytes()) for r, size in enumerate(sizes.tolist())]


def stop_ranks(procs: list[Any], group: ProcessGroup | None) -> None:
    """Tell the ranks to stop (if they can all hear it), then make sure they are gone, and
    close the group."""
    if group is not None and all(p.exitcode is None for p in procs):
        try:
            group.timeout_s = 2.0  # type: ignore[attr-defined]
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
