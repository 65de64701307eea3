"""Speculative decoding inside the engine (an engine part, as the prefix cache is): the proposer
the scheduler asks for a decoding sequence's draft, the draft's length chosen by cost, the
verification of the rows a draft's step scored, and the counts the worker exports under vLLM's
metric names.

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

The draft's length (k, 0 included) is chosen per sequence and step by cost (`DraftCost`): with
a per-token acceptance a (the sequence's recent drafts), a draft of k tokens yields 1 + a + ... +
a^k tokens for a step share of 1 + c k, where c is what one more row costs against a sequence's
share of a decode step, measured on this engine's own decode steps (a least-squares line of step
time against rows: on a MoE model a wider step also reads the extra experts its rows route to).
The k with the most tokens per cost wins; where no k > 0 beats a plain step, there is no draft.
A new sequence starts from the engine's acceptance over all its recent drafts (so repeated
requests under suffix decoding draft long from their first step); a sequence whose drafts keep
failing stops drafting, and its estimate drifts back to the engine's so that it tries again
later. Two guards keep a workload that copies little from paying for one that copied much
before it: a sequence's draft is at most 1 token at first and then 2 x its last draft's
accepted tokens + 1 (a miss costs one row, not k), and an n-gram or suffix draft is cut by
cost where drafts from matches of its length have been accepted less than the sequence's
estimate says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from evenflow.engine.config.settings import EngineConfig
from evenflow.engine.core.scheduler import ScheduledChunk
from evenflow.engine.core.sequence import Sequence
from evenflow.engine.model.transformer import CausalLM
from evenflow.engine.serving.draft_model import DraftModel, ModelDrafter, NextTokenDrafter
from evenflow.engine.spec.config import SpeculativeConfig
from evenflow.engine.spec.ngram import NgramIndex, NgramProposer
from evenflow.engine.spec.suffix import SuffixProposer
from evenflow.proto.kv_handoff import KVHandoffError, KVPayload
from evenflow.proto.sampling import TokenLogprobs

PRIOR_ACCEPTANCE = 0.5  # the engine's estimate before its first draft
ACCEPTANCE_MEMORY = 0.6  # weight of the old estimate at each verified draft
ENGINE_MEMORY = 0.9  # the same for the engine's estimate, over every sequence's drafts
DRIFT = 0.03  # a step without a draft moves the estimate this far back to the prior
PRIOR_ROW_COST = 0.3  # c before the engine has measured its steps
STEP_MEMORY = 0.98  # weight of the old sums in the step-time line, per decode step


@dataclass
class SpecCounts:
    """Since the engine started (vLLM's spec_decode metrics: num_drafts, num_draft_tokens,
    num_accepted_tokens, num_accepted_tokens_per_pos)."""

    drafts: int = 0  # verification steps
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


@dataclass
class SpecState:
    """One sequence's: its n-gram index and its acceptance estimate."""

    acceptance: float
    ngram: NgramIndex = field(default_factory=NgramIndex)
    draft_tokens: int = 0  # this request's, for its usage
    accepted_tokens: int = 0
    matched: int = 0  # its latest draft's match length (n-gram and suffix drafts)
    # the longest next draft: 1 at first, then 2 x the last draft's accepted tokens + 1 (a
    # sequence proves its drafts before they grow; a miss costs one row, not k)
    cap: int = 1


class DraftCost:
    """Step time against rows, a line fitted by exponentially weighted least squares over the
    engine's decode steps (no prefill in them): t = base + per_row * rows."""

    def __init__(self) -> None:
        self.n = self.x = self.y = self.xx = self.xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        m = STEP_MEMORY
        self.n, self.x, self.y = m * self.n + 1, m * self.x + rows, m * self.y + seconds
        self.xx, self.xy = m * self.xx + rows * rows, m * self.xy + rows * seconds

    def row_cost(self, batch: int) -> float:
        """c: one more row's time over a sequence's share of a plain step of `batch`."""
        if self.n < 8:
            return PRIOR_ROW_COST
        spread = self.xx / self.n - (self.x / self.n) ** 2
        if spread < 0.25:  # (all steps of one width so far: no slope to read)
            return PRIOR_ROW_COST
        per_row = max(0.0, (self.xy / self.n - self.x * self.y / self.n ** 2) / spread)
        base = max(0.0, self.y / self.n - per_row * self.x / self.n)
        share = base / max(1, batch) + per_row
        return per_row / share if share > 0 else PRIOR_ROW_COST


def best_draft_length(acceptance: float, row_cost: float, limit: int) -> int:
    """The k in [0, limit] with the most expected tokens per step share."""
    best_k, best, tokens, power = 0, 1.0, 1.0, 1.0
    for k in range(1, limit + 1):
        power *= acceptance
        tokens += power
        value = tokens / (1.0 + row_cost * k)
        if value > best * 1.0001:
            best_k, best = k, value
    return best_k


class Speculation:
    def __init__(self, config: SpeculativeConfig, drafter: ModelDrafter | None = None) -> None:
        """`drafter`: the draft_model or mtp method's model (engine/serving/draft_model.py)."""
        self.config = config
        self.drafter = drafter
        self.proposer: NgramProposer | SuffixProposer = (
            SuffixProposer(config) if config.method == "suffix" else NgramProposer(config))
        self.counts = SpecCounts(accepted_per_position=[0] * config.num_speculative_tokens)
        self.cost = DraftCost()
        self.row_cost = PRIOR_ROW_COST  # c, refitted after each decode step
        self.acceptance = PRIOR_ACCEPTANCE  # over every sequence's recent drafts
        # n-gram and suffix drafts: the engine's acceptance by the match's length (a 2-token
        # match in a chat guesses worse than an 8-token one in a repeated request)
        self.by_match: dict[int, float] = {}

    @classmethod
    def build(cls, config: SpeculativeConfig, engine_config: EngineConfig, model: CausalLM,
              dtype: torch.dtype, num_blocks: int, max_model_len: int) -> Speculation:
        """The engine's part, with the draft_model or mtp method's model (a KV cache of as
        many blocks as the target's: drafts never need more tokens than the target holds)."""
        drafter: ModelDrafter | None = None
        if config.method == "draft_model":
            assert config.model is not None
            drafter = DraftModel.load(engine_config, config.model, model, dtype, num_blocks,
                                      max_model_len)
        elif config.method == "mtp":
            drafter = NextTokenDrafter.load(engine_config, model, dtype, num_blocks,
                                            max_model_len)
            model.keep_hidden = True
        return cls(config, drafter)

    def propose(self, asks: list[tuple[Sequence, int]]) -> list[list[int]]:
        """The scheduler's Proposer: each decoding sequence's draft, of its length by cost."""
        lengths = [self._length(seq, limit) for seq, limit in asks]
        if self.drafter is not None:
            return self.drafter.propose([(seq, k) for (seq, _), k in zip(asks, lengths,
                                                                          strict=True)])
        return [self._matched_draft(seq, k) if k else []
                for (seq, _), k in zip(asks, lengths, strict=True)]

    def _matched_draft(self, seq: Sequence, k: int) -> list[int]:
        """The proposer's draft, cut by cost where its kind of match has guessed worse than
        the sequence's estimate (the estimate of a new sequence is the engine's, over whatever
        it drafted before: a chat after a copying workload)."""
        state = seq.spec_state
        draft = self.proposer.propose(seq.token_ids, k, state.ngram)
        state.matched = n = self.proposer.matched
        by_match = self.by_match.get(n)
        if draft and by_match is not None and by_match < state.acceptance:
            keep = best_draft_length(by_match, self.row_cost, len(draft)) \
                if by_match > self.row_cost else 0
            if keep == 0:  # (drifting back, as a sequence's estimate does, to try again)
                self.by_match[n] = by_match + DRIFT * (self.acceptance - by_match)
            draft = draft[:keep]
        return draft

    def _length(self, seq: Sequence, limit: int) -> int:
        state = seq.spec_state
        if not isinstance(state, SpecState):
            state = seq.spec_state = SpecState(self.acceptance)
        # (a draft of one pays only where acceptance beats a row's cost: a quick no first)
        k = best_draft_length(state.acceptance, self.row_cost, min(
            limit, state.cap, self.config.num_speculative_tokens)) \
            if state.acceptance > self.row_cost else 0
        if k == 0:
            state.acceptance += DRIFT * (self.acceptance - state.acceptance)
        return k

    def finished(self, seq: Sequence) -> None:
        """A sequence ended: suffix decoding caches its tokens for the requests to come; a
        draft model lets its shadow go."""
        if isinstance(self.proposer, SuffixProposer) and self.drafter is None:
            self.proposer.add(seq.token_ids)
        if self.drafter is not None:
            self.drafter.release(seq)

    def take_hidden(self, seq: Sequence, start: int, hidden: Tensor) -> None:
        """mtp: the target's final hidden states of the positions from `start` it kept."""
        if isinstance(self.drafter, NextTokenDrafter):
            self.drafter.take_hidden(seq, start, hidden)

    @staticmethod
    def request_counts(seq: Sequence) -> tuple[int, int]:
        """(draft tokens, accepted ones) over the request's steps so far."""
        state = seq.spec_state
        return (state.draft_tokens, state.accepted_tokens) if isinstance(state, SpecState) \
            else (0, 0)

    def hand_hidden(self, chunks: list[ScheduledChunk], starts: list[int],
                    hidden: list[Tensor]) -> None:
        """mtp, after a step: each sequence's final hidden states (the runner's chunk_hidden)
        for the positions the step kept (`starts`: each chunk's computed tokens before it)."""
        for chunk, start, rows in zip(chunks, starts, hidden, strict=True):
            if not chunk.seq.is_finished or chunk.seq.export_kv:  # (an export: for the hand-off)
                self.take_hidden(chunk.seq, start, rows[: chunk.seq.num_computed_tokens - start])

    def take_handed_hidden(self, seq: Sequence, kv: KVPayload) -> None:
        """mtp: the prompt's last hidden states from the engine that prefilled it (rows of the
        model's hidden size), for the next-token layer's first draft."""
        if not len(kv.hidden) or not isinstance(self.drafter, NextTokenDrafter):
            return
        width = self.drafter.model.config.hidden_size
        rows = torch.frombuffer(bytearray(kv.hidden), dtype=getattr(torch, kv.hidden_dtype))
        if rows.numel() % width or rows.numel() // width > seq.num_prompt_tokens:
            raise KVHandoffError(f"{rows.numel()} hidden-state values are not rows of "
                                 f"{width} for at most {seq.num_prompt_tokens} positions")
        rows = rows.view(-1, width).to(self.drafter.runner.dtype)
        self.take_hidden(seq, seq.num_prompt_tokens - len(rows), rows)

    def export_hidden(self, seq: Sequence) -> Tensor | None:
        """mtp, a prompt prefilled for another engine: its last hidden states, for the
        hand-off (engine/serving/draft_model.py HANDED_POSITIONS)."""
        if isinstance(self.drafter, NextTokenDrafter):
            return self.drafter.export_hidden(seq)
        return None

    @property
    def wants_hidden(self) -> bool:
        return isinstance(self.drafter, NextTokenDrafter)

    def observe_step(self, rows: int, seqs: int, seconds: float) -> None:
        """A decode step's time (every chunk one token or a draft): the cost line's data."""
        self.cost.observe(rows, seconds)
        self.row_cost = self.cost.row_cost(seqs)

    def verify(self, seq: Sequence, rows: Tensor, draft: tuple[int, ...],
               sample_row: Callable[[Tensor], int], stops: Callable[[int], bool]
               ) -> list[tuple[int, TokenLogprobs | None]]:
        """The tokens taken from a draft's rows (len(draft) + 1 of them), each appended to
        `seq` as it is sampled, with its logprobs; `stops(token)`: the sequence ends there.
        seq.num_computed_tokens then counts the K/V this step computed for taken tokens. A
        greedy sequence that processes no logits, asks no logprobs and follows no grammar
        takes each row's argmax, all rows at once (what sampling them one by one gives)."""
        p = seq.params
        if p.greedy and not p.processes_logits and p.logprobs is None and seq.guide is None:
            best = rows.argmax(dim=-1).tolist()
            return self._take(seq, draft, lambda j: best[j], stops)
        return self._take(seq, draft, lambda j: sample_row(rows[j : j + 1]), stops)

    def _take(self, seq: Sequence, draft: tuple[int, ...], token_at: Callable[[int], int],
              stops: Callable[[int], bool]) -> list[tuple[int, TokenLogprobs | None]]:
        taken: list[tuple[int, TokenLogprobs | None]] = []
        seq.num_computed_tokens += 1  # the token before the draft
        accepted = 0
        for j in range(len(draft) + 1):
            token = token_at(j)
            seq.token_ids.append(token)
            taken.append((token, seq.step_logprobs))
            hit = j < len(draft) and token == draft[j]
            if hit:
                accepted += 1
                self.counts.accepted_per_position[j] += 1
            if stops(token) or not hit:
                break
            seq.num_computed_tokens += 1  # draft j's K/V is the token's
        self._record(seq, len(draft), accepted)
        return taken

    def _record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        counts = self.counts
        counts.drafts += 1
        counts.draft_tokens += drafted
        counts.accepted_tokens += accepted
        # each position up to the first miss is a trial
        rate = accepted / max(1, accepted + (1 if accepted < drafted else 0))
        self.acceptance = ENGINE_MEMORY * self.acceptance + (1 - ENGINE_MEMORY) * rate
        state = seq.spec_state
        if isinstance(state, SpecState):
            state.acceptance = ACCEPTANCE_MEMORY * state.acceptance + \
                (1 - ACCEPTANCE_MEMORY) * rate
            state.draft_tokens += drafted
            state.accepted_tokens += accepted
            state.cap = 2 * accepted + 1
            if state.matched:
                old = self.by_match.get(state.matched, rate)
                self.by_match[state.matched] = ENGINE_MEMORY * old + (1 - ENGINE_MEMORY) * rate
