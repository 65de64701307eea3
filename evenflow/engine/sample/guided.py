"""Guided (structured) decoding in the engine: one llguidance matcher per sequence whose
SamplingParams carry a grammar (proto/grammar.py makes it from a JSON schema, regex, choice or
Lark grammar).

- A matcher is built off the step loop: `start` hands the grammar to a compile thread
  (llguidance drops the GIL while it builds) and the sequence keeps the future; the first step
  that samples the sequence waits for it, normally long done by the end of the prompt's forward.
- The batch's token masks are filled in parallel by llguidance's executor (GIL dropped), as one
  (rows, vocab/32) int32 bitmask, and applied to the logits in one masked_fill before sampling.
- Each sampled token is fed back to its matcher; a sequence whose grammar is complete finishes
  with "stop" at once (only EOS could follow).
A grammar that fails to build (the gateway validates first, so this is rare) ends its sequence
with "stop" and no output, logged; it never fails the rest of the batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import llguidance
import torch
from torch import Tensor

from evenflow.engine.core.sequence import Sequence
from evenflow.proto.grammar import GuideVocabulary, guide_vocabulary

log = logging.getLogger(__name__)
_BITS = torch.arange(32, dtype=torch.int32)


class Guides:
    """An engine's grammar matchers: built in a compile thread, stepped with the batch."""

    def __init__(self, model_dir: str | Path, eos_ids: Seq[int], vocab_size: int) -> None:
        self._model_dir = model_dir
        self._eos_ids = sorted(eos_ids)
        self._vocab_size = vocab_size
        self._compiler: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None

    def start(self, seq: Sequence) -> None:
        """Begin building seq's matcher (when it asks for a grammar). It first consumes the
        output made elsewhere: the prompt's last `resumed_output_tokens` (a retried request's
        earlier output) and any token past the prompt (a prefill worker's first token)."""
        grammar = seq.params.guide
        if not grammar:
            return
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(1, thread_name_prefix="evenflow-guide")
        made_elsewhere = seq.token_ids[seq.num_prompt_tokens - seq.params.resumed_output_tokens:]
        seq.guide = self._compiler.submit(self._build, grammar, made_elsewhere)

    def vocabulary(self) -> GuideVocabulary:
        return guide_vocabulary(self._model_dir, self._eos_ids, self._vocab_size)

    def _build(self, grammar: str, consumed: list[int]) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.vocabulary().tokenizer, grammar, log_level=0)
        for token in consumed:
            if matcher.is_error() or not matcher.consume_token(token):
                break
        if matcher.is_error():
            raise ValueError(matcher.get_error().splitlines()[0])
        return matcher

    @staticmethod
    def _matcher(seq: Sequence) -> llguidance.LLMatcher | None:
        """seq's matcher, waiting for its build; None if the build failed (the sequence then
        may only end)."""
        guide = seq.guide
        if isinstance(guide, Future):
            try:
                guide = guide.result()
            except Exception as exc:  # a grammar the gateway would have refused
                log.warning("request %s: its grammar failed to build: %s", seq.request_id, exc)
                guide = None
            seq.guide = guide if guide is not None else False
        return guide or None

    def mask(self, logits: Tensor, seqs: list[Sequence]) -> Tensor:
        """logits (S, V) with every token the rows' grammars forbid at -inf (a new tensor
        when any row is guided)."""
        rows = [i for i, s in enumerate(seqs) if s.guide is not None]
        if not rows:
            return logits
        vocab = logits.shape[1]
        known = self.vocabulary()
        words = known.mask_words
        bitmask = torch.zeros(len(rows), words, dtype=torch.int32)
        pairs, failed = [], []
        for j, i in enumerate(rows):
            matcher = self._matcher(seqs[i])
            if matcher is None or matcher.is_error():
                failed.append(j)
            else:
                pairs.append((matcher, j))
        if pairs:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4,
                                                   len(rows))
        allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).view(len(rows), -1)[:, :vocab].bool()
        if allowed.shape[1] < vocab:  # logits wider than the tokenizer: the rest never
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
        never = [t for t in known.never_sampled if t < vocab]
        if never:
            allowed[:, never] = False
        # A dead end (the vocabulary cannot spell what the grammar needs next) or a failed
        # build: the sequence can only end.
        stuck = ~allowed.any(dim=1)
        stuck[failed] = True
        if bool(stuck.any()):
            eos_only = torch.zeros(vocab, dtype=torch.bool)
            eos_only[self._eos_ids] = True
            allowed[stuck] = eos_only
        masked = logits[rows].masked_fill(~allowed, float("-inf"))
        dead = torch.isneginf(masked).all(dim=-1)  # min_tokens banned what the grammar needs
        if bool(dead.any()):
            masked[dead] = torch.zeros_like(masked[dead]).masked_fill(~allowed[dead],
                                                                      float("-inf"))
        out = logits.clone()
        out[rows] = masked
        return out

    def advance(self, seqs: list[Sequence], tokens: list[int]) -> None:
        """Feed each guided sequence's sampled token to its matcher."""
        for seq, token in zip(seqs, tokens, strict=True):
            matcher = seq.guide
            if not matcher or isinstance(matcher, Future) or token in self._eos_ids:
                continue  # (EOS ends the sequence: nothing to match after it)
            if not matcher.consume_token(token):
                log.warning("request %s: token %d broke its grammar: %s", seq.request_id,
                            token, matcher.get_error().splitlines()[0])

    @staticmethod
    def complete(seq: Sequence) -> bool:
        """Whether seq's grammar has ended (or failed to build): nothing but EOS may follow."""
        guide: Any = seq.guide
        if guide is None or isinstance(guide, Future):
            return False
        return guide is False or bool(guide.is_stopped())

    def close(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)
