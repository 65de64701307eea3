"""Prompt lookup (vLLM's `ngram` method): the draft is what followed the latest earlier
occurrence of the sequence's last n tokens, for the longest n from prompt_lookup_max down to
prompt_lookup_min that occurs, up to k tokens. It costs a scan of the sequence per step (numpy,
a few microseconds a thousand tokens) and no model."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from evenflow.engine.spec.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.low, self.high = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """At most min(k, limit) draft tokens to follow `token_ids` ([] when no n-gram
        recurs)."""
        k = min(self.k, limit)
        if k <= 0 or len(token_ids) <= self.low:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.high, len(tokens) - 1), self.low - 1, -1):
            # windows starting before the suffix itself: [i, i + n) with i + n < len
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []
