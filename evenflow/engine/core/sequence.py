"""A request inside the engine: its tokens, its place in the KV cache and its progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from evenflow.proto.sampling import SamplingParams, TokenLogprobs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop token / string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    params: SamplingParams
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)  # KV block ids, in token order
    # A hybrid model's sliding-window layers' blocks, in token order, -1 where a block lies
    # wholly behind the window (freed) or was never needed (core/window_blocks.py)
    window_table: list[int] = field(default_factory=list)
    # the sliding layers' cached blocks its latest prefix lookup found: logical block -> block
    window_hits: dict[int, int] = field(default_factory=dict)
    window_released: int = 0  # window_table's entries before this are all -1
    spec_state: Any = None  # its draft proposer's state (engine/spec/ngram.py NgramIndex)
    block_hashes: list[int] = field(default_factory=list)  # chained hash of each full block
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first schedule)
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None  # per-request RNG when a seed is given
    num_preemptions: int = 0
    # the scheduler's: (priority it was admitted with, arrival number), the order of the
    # running list; when it began waiting (time.monotonic()), for aging; after a preemption,
    # a negative number that puts it before its equals in the waiting queue
    rank: tuple[int, int] = (0, 0)
    waiting_since: float = 0.0
    requeued: int = 0
    # why its latest prefix lookup stopped at a block the KV disk tier held or had just dropped
    # ("": it did not; core/block_manager.py's MISS_REASONS)
    disk_miss: str = ""
    export_kv: bool = False  # hand the prompt's K/V to the caller when it finishes
    pending_kv: torch.Tensor | None = None  # imported prompt K/V, written in at admission
    # The last sampled token's (logprob, top ids, top logprobs) when params.logprobs is set
    step_logprobs: TokenLogprobs | None = None
    # params.prompt_logprobs: (logprob, top ids, top logprobs) of prompt tokens 1, 2, ...
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # params.guide: its grammar matcher (a Future while it builds; False if the build failed;
    # engine/sample/guided.py)
    guide: Any = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    def skip_draws(self, steps: int, vocab_size: int) -> None:
        """Advance the seeded generator past `steps` sampling steps taken elsewhere (the
        prefill worker sampled the first token), so the output matches a single engine's."""
        if self.generator is not None and not self.params.greedy:
            for _ in range(steps):
                torch.empty(vocab_size).exponential_(generator=self.generator)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
