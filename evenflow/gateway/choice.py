"""One choice's output at the gateway, one token delta at a time: incremental detokenization,
stop strings, logprobs, usage and the per-token metrics (`ChoiceOutput.take`). Synchronous,
so that both ways a delta reaches a stream share it: the request's task (an async generator,
Gateway.run), and the direct path (gateway/direct.py), which the NATS inbox calls for an
in-order delta in the middle of a stream while that task sleeps."""

from __future__ import annotations

from evenflow.gateway.flight import RequestFailed
from evenflow.gateway.render import Piece, TokenLogprob
from evenflow.proto import errors
from evenflow.proto.messages import TokenDelta
from evenflow.proto.tokenizer import IncrementalDetokenizer
from evenflow.services.metrics import TTFT, VLLM_ITL, VLLM_TTFT, labelled


class ChoiceOutput:
    """What one choice's deltas become: text pieces, and its job's usage and timings."""

    def __init__(self, job, detok: IncrementalDetokenizer, vocab: int, started: float,
                 unprinted: frozenset[int] = frozenset()) -> None:
        self.job, self.detok, self.vocab = job, detok, vocab
        # token ids kept out of the text (the end of sequence, where special tokens print)
        self.unprinted = unprinted
        self.first = True
        # a piece went to the request's task (which renders the stream's first event: the
        # chat role, the first-chunk timing); until then the direct path takes nothing
        self.streamed = False
        self.previous = job.prompt_ids[-1]  # the token before the next one (logprob texts)
        self.last = started  # when the latest delta came (time.monotonic())
        self.itl = labelled(VLLM_ITL, job.model)

    def in_vocab(self, ids: list[int]) -> bool:
        return not ids or 0 <= min(ids) <= max(ids) < self.vocab

    def check(self, delta: TokenDelta) -> None:
        """A broken or forged worker's token ids are its failure, not our 500."""
        if not self.in_vocab(delta.token_ids):
            raise RequestFailed(errors.WORKER_ERROR, "a worker sent a token id outside the "
                                f"vocabulary [0, {self.vocab})")

    def take(self, delta: TokenDelta, now: float) -> Piece | None:
        """The piece this delta adds (None: nothing to stream yet); its finish reason is set
        when the choice ends here (a stop string, or the worker's finish). Raises
        RequestFailed for token ids outside the vocabulary."""
        self.check(delta)
        job = self.job
        if self.first:
            self._first(delta, now)
        else:
            self.count(len(delta.token_ids), now)
        self._count_drafts(delta)
        logprobs = []
        if job.logprobs is not None:
            previous = self.previous
            for token, lp, top_ids, top_lps in zip(
                    delta.token_ids, delta.logprobs, delta.top_logprob_ids,
                    delta.top_logprobs, strict=False):
                logprobs.append(TokenLogprob(lp, top_ids, top_lps, token_id=token,
                                             previous_id=previous))
                previous = token
            self.previous = previous
        ids = delta.token_ids
        if self.unprinted:
            ids = [t for t in ids if t not in self.unprinted]
        text = self.detok.add(ids)
        if self.detok.stopped:  # a stop string: cut here; the stream cancels downstream
            return Piece(text, "stop", logprobs)
        finish = delta.finish_reason
        if finish is not None:
            return Piece(text + self.detok.flush(), "stop" if finish == "abort" else finish,
                         logprobs)
        if not (text or logprobs):
            return None
        self.streamed = True
        return Piece(text, None, logprobs)

    def count(self, tokens: int, now: float) -> None:
        """Usage and inter-token latency for `tokens` more output tokens, arrived at `now`."""
        self.job.usage.completion_tokens += tokens
        if tokens:
            gap = (now - self.last) / tokens
            for _ in range(tokens):
                self.itl.observe(gap)
        self.last = now

    def _first(self, delta: TokenDelta, now: float) -> None:
        job = self.job
        if delta.prompt_logprobs:
            ids = job.prompt_ids
            job.prompt_logprobs = [
                TokenLogprob(lp, top_ids, top_lps, token_id=ids[i + 1], previous_id=ids[i])
                for i, (lp, top_ids, top_lps) in enumerate(zip(
                    delta.prompt_logprobs, delta.prompt_top_logprob_ids,
                    delta.prompt_top_logprobs, strict=False))]
        job.ttft_s = now - self.last
        TTFT.observe(job.ttft_s)
        labelled(VLLM_TTFT, job.model).observe(job.ttft_s)
        job.usage.cached_tokens = delta.num_cached_tokens
        job.usage.completion_tokens += len(delta.token_ids)
        self.first = False
        self.last = now

    def plain_text(self, delta: TokenDelta, now: float) -> str | None:
        """The direct path's take of a delta in the middle of a plain stream (no logprobs, not
        the first, no finish): its text, with usage and metrics counted; None, with nothing
        changed, where the delta needs the request's task (a stop string ends the choice here,
        or a token id is out of range)."""
        ids = delta.token_ids
        if not self.streamed or not self.in_vocab(ids):
            return None  # (the first event is the task's: a first token of no text held it)
        mark = self.detok.mark()
        text = self.detok.add(ids)
        if self.detok.stopped:
            self.detok.rewind(mark)
            return None
        self.count(len(ids), now)
        self._count_drafts(delta)
        return text

    def _count_drafts(self, delta: TokenDelta) -> None:
        """Speculative decoding's drafts, with the request's last delta."""
        if delta.draft_tokens:
            self.job.usage.draft_tokens += delta.draft_tokens
            self.job.usage.accepted_draft_tokens += delta.accepted_draft_tokens
