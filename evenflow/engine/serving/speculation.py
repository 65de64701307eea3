"""Speculative decoding inside the engine (an engine part, as the prefix cache is): the proposer
the scheduler asks for a decoding sequence's draft, the verification of the rows a draft's
step scored, and the counts the worker exports under vLLM's metric names.

Verification samples the step's rows in order, each as the sequence's next token would be
sampled without speculation (penalties, guided decoding, logprobs and seeds see the tokens taken
so far), and keeps going while the sampled token equals the draft's: the tokens taken are the
accepted draft plus one more, sampled at the first mismatch (or after the whole draft). For a
draft that is a fixed guess (n-gram), this is the rejection sampling of speculative decoding
exactly: token t is kept with the target's probability p(t), and on a miss the token drawn is
distributed as p without t, renormalized. Greedy output is therefore identical to decoding
without speculation, and sampling keeps its distribution. The rejected tokens' K/V slots lie
past num_computed_tokens: they are overwritten before anything reads them, and never hashed,
cached or published (only computed, accepted tokens are).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from evenflow.engine.core.sequence import Sequence
from evenflow.engine.spec.config import SpeculativeConfig
from evenflow.engine.spec.ngram import NgramProposer
from evenflow.proto.sampling import TokenLogprobs


@dataclass
class SpecCounts:
    """Since the engine started (vLLM's spec_decode metrics: num_drafts, num_draft_tokens,
    num_accepted_tokens, num_accepted_tokens_per_pos)."""

    drafts: int = 0  # verification steps
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class Speculation:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = NgramProposer(config)
        self.counts = SpecCounts(accepted_per_position=[0] * config.num_speculative_tokens)

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        return self.proposer.propose(seq, limit)

    def verify(self, seq: Sequence, rows: Tensor, draft: tuple[int, ...],
               sample_row: Callable[[Tensor], int], stops: Callable[[int], bool]
               ) -> list[tuple[int, TokenLogprobs | None]]:
        """The tokens taken from a draft's rows (len(draft) + 1 of them), each appended to
        `seq` as it is sampled, with its logprobs; `stops(token)`: the sequence ends there.
        seq.num_computed_tokens then counts the K/V this step computed for taken tokens."""
        taken: list[tuple[int, TokenLogprobs | None]] = []
        seq.num_computed_tokens += 1  # the token before the draft
        accepted = 0
        for j in range(len(draft) + 1):
            token = sample_row(rows[j : j + 1])
            seq.token_ids.append(token)
            taken.append((token, seq.step_logprobs))
            hit = j < len(draft) and token == draft[j]
            if hit:
                accepted += 1
                self.counts.accepted_per_position[j] += 1
            if stops(token) or not hit:
                break
            seq.num_computed_tokens += 1  # draft j's K/V is the token's
        counts = self.counts
        counts.drafts += 1
        counts.draft_tokens += len(draft)
        counts.accepted_tokens += accepted
        return taken
