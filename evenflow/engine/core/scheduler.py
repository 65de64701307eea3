"""Iteration-level continuous batching.

Each step gets a token budget. Running sequences go first, in arrival order: one token each when
decoding, or the next chunk of their prompt (chunked prefill). Waiting sequences are then admitted
while budget, KV blocks and the running cap allow, reusing cached prefix blocks; one whose next
block another sequence is computing waits a step and takes it from the cache. When a running
sequence needs a block and none is free, the most recently admitted sequence is preempted: its
blocks are freed and it is recomputed later (its full blocks usually stay cached, so the redo is
mostly prefix hits).

Priority (SamplingParams.priority, vLLM's meaning: lower is sooner): waiting sequences are
admitted best first, by their priority less one level per `priority_aging_s` waited (10 s:
priority holds through a burst, and nothing starves), ties in arrival order, a preempted
sequence first among its equals; running sequences are kept in rank order (the rank they were
admitted with), so a step serves the best first and a preemption takes the worst: the lowest
priority, then the most recently admitted. A waiting sequence that ranks above the worst
running one and finds no room (KV blocks, the running cap) preempts it, and a step that admits
a better priority admits nothing worse (its prefill shares the step with no lower one: its time
to first token). With every priority 0 (the common case) this is the FIFO above, at its cost.

With a proposer (speculative decoding: engine/spec/), a decoding sequence's step may carry draft
tokens after its last one: the chunk then holds 1 + len(draft) tokens, their KV slots reserved,
and the engine keeps the accepted prefix (engine/serving/speculation.py). A draft that does not
fit the blocks left is dropped, never the cause of a preemption.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from evenflow.engine.core.block_manager import BlockManager
from evenflow.engine.core.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # cap on running sequences
    max_num_batched_tokens: int = 2048  # token budget per step
    max_model_len: int = 4096
    # A waiting sequence whose next block a running one is computing waits a step for the hit.
    defer_shared_prefill: bool = True
    # A waiting sequence's priority improves by one level per this many seconds waited (0: no
    # aging); it keeps the rank it reached once running.
    priority_aging_s: float = 10.0
    # LoRA adapters running in one step at most (SamplingParams.lora_name)
    max_loras: int = 4

    def __post_init__(self) -> None:
        assert self.max_num_seqs >= 1 and self.max_num_batched_tokens >= 1


# [(a decoding sequence, at most this many)] -> the draft tokens to follow each one's tokens
# (all of a step's asked at once: a draft model runs them batched)
Proposer = Callable[[list[tuple[Sequence, int]]], list[list[int]]]


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # new tokens computed for it this step (its draft's included)
    draft: tuple[int, ...] = ()  # proposed tokens after the sequence's last one, to verify

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a next token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens - len(self.draft) == \
            self.seq.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager,
                 proposer: Proposer | None = None) -> None:
        self.config, self.blocks, self.proposer = config, blocks, proposer
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in rank order (Sequence.rank)
        self.num_preemptions = 0
        self.num_priority_preemptions = 0  # of those, made for a better-ranked waiting one
        self._arrivals = 0  # arrival counter: the tie-break within a priority
        self._preempted = 0  # preemption counter: a preempted sequence goes before its equals
        self._prioritized = 0  # unfinished sequences with a priority other than 0

    def add(self, seq: Sequence) -> None:
        self._arrivals += 1
        seq.rank = (seq.params.priority, self._arrivals)
        seq.waiting_since = time.monotonic()
        if seq.params.priority:
            self._prioritized += 1
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        """Pick this step's work. Prefill chunks come first in the result, decodes after."""
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        drafts = self._drafts(budget)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            draft = drafts.get(id(seq), ())[: budget - 1]
            target = seq.num_computed_tokens + n + len(draft)
            if draft and not self.blocks.can_append(seq, target):
                draft, target = (), target - len(draft)
            while not self.blocks.can_append(seq, target) and self.running[-1] is not seq:
                self._preempt(self.running.pop())
            if not self.blocks.can_append(seq, target):
                self.running.pop(i)  # it is the last one: preempt itself
                self._preempt(seq)
                continue
            self.blocks.append_slots(seq, target)
            chunks.append(ScheduledChunk(seq, n + len(draft), draft))
            budget -= n + len(draft)
            i += 1

        if self._prioritized and len(self.waiting) > 1:
            self._order_waiting()
        in_flight = (self._blocks_in_flight()
                     if self.config.defer_shared_prefill and self.waiting else None)
        deferred: list[Sequence] = []
        evicted: list[Sequence] = []  # preempted for a better-ranked one: back next step
        best_admitted: int | None = None  # (priorities mixed: the first admitted's rank)
        adapters = {s.params.lora_name for s in self.running if s.params.lora_name}
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            lora = seq.params.lora_name
            if lora and lora not in adapters and len(adapters) >= self.config.max_loras:
                deferred.append(self.waiting.popleft())  # a batch of other adapters is full
                continue
            if self._prioritized:
                seq.rank = (self._aged(seq), seq.rank[1])
                if best_admitted is not None and seq.rank[0] > best_admitted:
                    break  # a step that admits a better priority admits nothing worse: its
                    # prefill shares the step with no lower one (time to its first token)
            if len(self.running) >= self.config.max_num_seqs:
                if not self._make_room(seq, chunks, evicted):
                    break
                budget = self.config.max_num_batched_tokens - sum(c.num_tokens for c in chunks)
                continue
            if seq.pending_kv is not None:  # prompt K/V imported: only the next token to run
                if not self.blocks.can_allocate_first(seq, [], seq.num_tokens):
                    if not self._make_room(seq, chunks, evicted):
                        break
                    budget = (self.config.max_num_batched_tokens
                              - sum(c.num_tokens for c in chunks))
                    continue
                self.waiting.popleft()
                cached = seq.num_cached_tokens
                self.blocks.allocate_first(seq, [], seq.num_tokens)
                seq.num_computed_tokens, seq.num_cached_tokens = seq.num_prompt_tokens, cached
                seq.status = SequenceStatus.RUNNING
                self._run(seq)
                chunks.append(ScheduledChunk(seq, seq.num_tokens - seq.num_computed_tokens))
                budget -= chunks[-1].num_tokens
                continue
            # prompt logprobs need every prompt token's logits: nothing from the cache
            hits = [] if seq.params.prompt_logprobs is not None else self.blocks.prefix_hits(seq)
            if (in_flight is not None and len(hits) < len(seq.block_hashes)
                    and seq.block_hashes[len(hits)] in in_flight):
                # Its next block is being computed for another sequence: wait for the cache hit
                # instead of computing it twice (a burst of requests sharing a new prefix).
                deferred.append(self.waiting.popleft())
                continue
            computed = len(hits) * self.blocks.block_size
            n = min(seq.num_tokens - computed, budget)
            if not self.blocks.can_allocate_first(seq, hits, computed + n):
                if not self._make_room(seq, chunks, evicted):
                    break
                budget = self.config.max_num_batched_tokens - sum(c.num_tokens for c in chunks)
                continue  # (its hits are looked up again: the victim's blocks may be among them)
            self.waiting.popleft()
            self.blocks.allocate_first(seq, hits, computed + n)
            seq.status = SequenceStatus.RUNNING
            self._run(seq)
            if lora:
                adapters.add(lora)
            if best_admitted is None:
                best_admitted = seq.rank[0]
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
            if in_flight is not None:
                in_flight.update(seq.block_hashes[len(hits):])
        self.waiting.extendleft(reversed(deferred))
        self.waiting.extend(evicted)  # (ordered by rank next step: priorities are mixed)
        # Prefill chunks first, then single-token decodes: the model runner's batch layout.
        return [c for c in chunks if c.num_tokens > 1] + [c for c in chunks if c.num_tokens == 1]

    def _run(self, seq: Sequence) -> None:
        """Into the running list at its rank (the end, when priorities are all 0)."""
        seq.requeued = 0
        if not self._prioritized or not self.running or self.running[-1].rank <= seq.rank:
            self.running.append(seq)
        else:
            bisect.insort(self.running, seq, key=lambda s: s.rank)

    def _aged(self, seq: Sequence) -> int:
        """A waiting sequence's priority, less a level per priority_aging_s it has waited."""
        aging = self.config.priority_aging_s
        if aging <= 0:
            return seq.params.priority
        return seq.params.priority - int((time.monotonic() - seq.waiting_since) / aging)

    def _order_waiting(self) -> None:
        """Best first: aged priority, then preempted ones (most recent first), then arrival."""
        ranked = sorted(self.waiting, key=lambda s: (self._aged(s), s.requeued, s.rank[1]))
        self.waiting = deque(ranked)

    def _make_room(self, seq: Sequence, chunks: list[ScheduledChunk],
                   evicted: list[Sequence]) -> bool:
        """Preempt the worst running sequence for `seq` if it ranks below it (its chunk for
        this step, if it had one, taken back; it waits in `evicted` until the step is
        planned); whether one was preempted."""
        if not self._prioritized or not self.running:
            return False
        victim = self.running[-1]
        if victim.rank[0] <= seq.rank[0]:
            return False  # not for an equal or a better one: only priority preempts
        self.running.pop()
        for i, chunk in enumerate(chunks):
            if chunk.seq is victim:
                del chunks[i]
                break
        self._preempt(victim)
        self.waiting.popleft()  # (_preempt put it first)
        evicted.append(victim)
        self.num_priority_preemptions += 1
        return True

    def _drafts(self, budget: int) -> dict[int, tuple[int, ...]]:
        """The proposer's drafts for the decoding sequences (by id()): each no longer than
        the step's budget leaves after one token a sequence, its max_tokens and the context
        leave after the token the step samples anyway (cut to the budget left in its turn)."""
        if self.proposer is None:
            return {}
        room = budget - len(self.running)
        asks = []
        for seq in self.running:
            if seq.num_tokens - seq.num_computed_tokens != 1:
                continue
            limit = min(room, seq.params.max_tokens - seq.num_output_tokens - 1,
                        self.config.max_model_len - seq.num_tokens - 1)
            if limit > 0:
                asks.append((seq, limit))
        if not asks:
            return {}
        return {id(seq): tuple(draft) for (seq, _), draft in zip(
            asks, self.proposer(asks), strict=True) if draft}

    def _blocks_in_flight(self) -> set[int]:
        """Hashes of full blocks that running sequences have yet to compute (or are computing
        now): a waiting sequence needing one of them next is better off waiting a step."""
        bs = self.blocks.block_size
        return {h for seq in self.running
                for h in seq.block_hashes[seq.num_computed_tokens // bs:]}

    def finish(self, seq: Sequence, reason: FinishReason, free_blocks: bool = True) -> None:
        """Done: out of the queues; its blocks freed unless the caller frees them later."""
        if seq.params.priority and seq.status != SequenceStatus.FINISHED:
            self._prioritized -= 1
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        if free_blocks:
            self.blocks.free_sequence(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free_sequence(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted += 1
        seq.requeued = -self._preempted  # (most recently preempted first among its equals)
        seq.waiting_since = time.monotonic()
        self.waiting.appendleft(seq)
