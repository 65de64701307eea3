"""Prompt lookup (vLLM's `ngram` method): the draft is what followed the latest earlier
occurrence of the sequence's last n tokens, for the longest n from prompt_lookup_max down to
prompt_lookup_min that occurs, up to k tokens. Each sequence keeps an index of its n-grams (the
latest start of each), extended by the tokens added since the last step, so a proposal costs a
few dictionary lookups however long the sequence is, and no model."""

from __future__ import annotations

from dataclasses import dataclass, field

from evenflow.engine.spec.config import SpeculativeConfig


@dataclass
class NgramIndex:
    """One sequence's n-grams (as tuples) -> the latest position they start at, for every
    n-gram that ends before `indexed` (the sequence's last token is never indexed: a lookup of
    the suffix finds an earlier occurrence, never the suffix itself)."""

    starts: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are in `starts`


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.low, self.high = config.prompt_lookup_min, config.prompt_lookup_max
        self.matched = 0  # the last proposal's match length (0: none)

    def propose(self, tokens: list[int], limit: int, index: NgramIndex | None = None
                ) -> list[int]:
        """At most min(k, limit) draft tokens to follow `tokens` ([] when no n-gram recurs);
        `index`: the sequence's own, brought up to date here (a fresh one without)."""
        k = min(self.k, limit)
        found = self.match(tokens, index) if k > 0 else None
        if found is None:
            self.matched = 0
            return []
        n, start = found
        self.matched = n
        return tokens[start + n : start + n + k]

    def match(self, tokens: list[int], index: NgramIndex | None = None
              ) -> tuple[int, int] | None:
        """(n, where the latest earlier occurrence of tokens' last n starts) for the longest n
        that recurs; None when none does."""
        if len(tokens) <= self.low:
            return None
        index = self._extend(tokens, index or NgramIndex())
        for n in range(min(self.high, len(tokens) - 1), self.low - 1, -1):
            start = index.starts.get(tuple(tokens[-n:]))
            if start is not None:
                return n, start
        return None

    def _extend(self, tokens: list[int], index: NgramIndex) -> NgramIndex:
        last = len(tokens) - 1  # n-grams ending at positions before the last token
        for end in range(index.indexed, last):
            for n in range(self.low, min(self.high, end + 1) + 1):
                index.starts[tuple(tokens[end - n + 1 : end + 1])] = end - n + 1
        index.indexed = max(index.indexed, last)
        return index
