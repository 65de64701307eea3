"""Prompt lookup (vLLM's `ngram` method): the draft is what followed an earlier occurrence of
the sequence's last n tokens, for the longest n from prompt_lookup_max down to
prompt_lookup_min that occurs (the latest such occurrence), up to k tokens.

Each sequence keeps an index of its prompt_lookup_min-grams: the latest CANDIDATES starts of
each, extended by the tokens added since the last step. A proposal looks the sequence's last
prompt_lookup_min tokens up once (no occurrence, the common case in text that copies nothing:
one lookup and done) and extends each candidate backwards, token by token, up to
prompt_lookup_max. A longer n-gram's occurrence ends in one of its min-gram's, so this finds the
longest match among the latest CANDIDATES occurrences of the min-gram: the same as indexing
every n-gram wherever the min-gram recurs less often than that. It costs a lookup and an insert
a token however long the sequence is, and no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from evenflow.engine.spec.config import SpeculativeConfig

CANDIDATES = 4  # occurrences of a min-gram kept: the latest ones


@dataclass
class NgramIndex:
    """One sequence's prompt_lookup_min-grams (as tuples) -> the starts of their latest
    occurrences (oldest first), for every one that ends before `indexed` (the sequence's last
    token is never indexed: a lookup of the suffix finds an earlier occurrence, never the
    suffix itself)."""

    starts: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    indexed: int = 0  # min-grams ending before this position are in `starts`


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
        low = self.low
        if len(tokens) <= low:
            return None
        index = self._extend(tokens, index or NgramIndex())
        found = index.starts.get(tuple(tokens[-low:]))
        if found is None:
            return None
        best_n, best_start = 0, 0
        last = len(tokens) - 1
        for start in reversed(found):  # latest first: a tie keeps the latest
            n = low
            while n < self.high and start - (n - low) > 0 and \
                    tokens[start - (n - low) - 1] == tokens[last - n]:
                n += 1
            if n > best_n:
                best_n, best_start = n, start - (n - low)
        return best_n, best_start

    def _extend(self, tokens: list[int], index: NgramIndex) -> NgramIndex:
        low, starts = self.low, index.starts
        last = len(tokens) - 1  # min-grams ending at positions before the last token
        for end in range(max(index.indexed, low - 1), last):
            key = tuple(tokens[end - low + 1 : end + 1])
            found = starts.get(key)
            if found is None:
                starts[key] = [end - low + 1]
            else:
                found.append(end - low + 1)
                if len(found) > CANDIDATES:
                    del found[0]
        index.indexed = max(index.indexed, last)
        return index
