"""Suffix decoding (vLLM's `suffix` method, after Arctic Inference's): drafts from what followed
the sequence's latest tokens anywhere in the worker's recent requests, prompts and outputs both,
so a request that repeats an earlier one (an agent's loop, a retried call) gets the earlier
answer as its draft. The longer the match, the longer the draft: at most max_spec_factor times
the matched length (and num_speculative_tokens).

A simplification of Arctic's suffix trees: an index of n-grams (n from prompt_lookup_min to
MAX_MATCH) over the last max_cached_requests finished requests, each n-gram mapped to its latest
occurrence; the sequence's own n-grams (engine/spec/ngram.py) are looked up first, with the same
rule. Memory: MAX_MATCH - min + 1 entries per cached token.
"""

from __future__ import annotations

from collections import deque

from evenflow.engine.spec.config import SpeculativeConfig
from evenflow.engine.spec.ngram import NgramIndex, NgramProposer

MAX_MATCH = 8  # the longest n-gram indexed across requests


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k, self.low = config.num_speculative_tokens, config.prompt_lookup_min
        self.factor = config.suffix_decoding_max_spec_factor
        self.own = NgramProposer(SpeculativeConfig(
            num_speculative_tokens=config.num_speculative_tokens, prompt_lookup_min=self.low,
            prompt_lookup_max=max(self.low, MAX_MATCH)))
        self.cached: deque[list[int]] = deque()
        self.capacity = config.suffix_decoding_max_cached_requests
        # n-gram -> (the cached request's tokens, where the n-gram starts in them)
        self.starts: dict[tuple[int, ...], tuple[list[int], int]] = {}
        self.matched = 0  # the last proposal's match length (0: none)

    def propose(self, tokens: list[int], limit: int, index: NgramIndex | None = None
                ) -> list[int]:
        """The draft after the longest match of `tokens`' end, in its own earlier tokens or in
        the cached requests' (its own on a tie), at most factor x the match's length."""
        k = min(self.k, limit)
        self.matched = 0
        if k <= 0 or len(tokens) <= self.low:
            return []
        own = self.own.match(tokens, index)
        source, n, start = (tokens, *own) if own is not None else (tokens, 0, 0)
        for m in range(min(MAX_MATCH, len(tokens)), n, -1):
            found = self.starts.get(tuple(tokens[-m:]))
            if found is not None:
                source, n, start = found[0], m, found[1]
                break
        if n == 0:
            return []
        self.matched = n
        return source[start + n : start + n + min(k, max(1, int(self.factor * n)))]

    def add(self, tokens: list[int]) -> None:
        """A finished request's tokens (prompt and output) into the cache, the oldest dropped
        past capacity."""
        if self.capacity <= 0:
            return
        tokens = list(tokens)
        self.cached.append(tokens)
        for end in range(self.low - 1, len(tokens) - 1):  # (a gram with a token after it)
            for n in range(self.low, min(MAX_MATCH, end + 1) + 1):
                self.starts[tuple(tokens[end - n + 1 : end + 1])] = (tokens, end - n + 1)
        while len(self.cached) > self.capacity:
            self._drop(self.cached.popleft())

    def _drop(self, tokens: list[int]) -> None:
        for end in range(self.low - 1, len(tokens) - 1):
            for n in range(self.low, min(MAX_MATCH, end + 1) + 1):
                gram = tuple(tokens[end - n + 1 : end + 1])
                found = self.starts.get(gram)
                if found is not None and found[0] is tokens:
                    del self.starts[gram]
