"""Runner: what the engine asks of a model runner - the model's own (runners/model_runner.py
ModelRunner), a tensor-parallel leader's (runners/tp.py TPLeaderRunner, which sends each call
to its ranks first) or the mock engine's (api/mock.py MockRunner, a timing model). What only
the model's runner has (its KV cache spec, placements, the lockstep's dummy forward) the engine
reaches through `model_runner()`, which says so where a mock runs."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from evenflow.engine.core.scheduler import ScheduledChunk
from evenflow.engine.sample.guided import Guides


class Runner(Protocol):
    guides: Guides | None  # the engine's grammar matchers (structured output)
    expert_counts: Tensor  # (MoE layers, experts) tokens routed since the engine took them

    def run(self, chunks: list[ScheduledChunk]) -> list[int | Tensor]:
        """One step: the scheduled chunks' forward pass; the sampled token of each chunk that
        samples, in order (a chunk with a draft: its rows' logits, which the engine verifies)."""

    def read_kv(self, block_ids: list[int], window_ids: list[int] | None = None) -> Tensor:
        """These blocks' K/V in the hand-off layout (proto/kv_handoff.py); `window_ids`: the
        same blocks in the sliding-window layers' table, where they keep their own."""

    def write_kv(self, block_ids: list[int], kv: Tensor, window_ids: list[int] | None = None
                 ) -> None:
        """K/V in the hand-off layout into these blocks."""

    def kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The hand-off layout's shape for this many blocks."""
