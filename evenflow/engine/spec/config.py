"""The speculative decoding configuration, as vLLM takes it: `speculative_config={"method":
"ngram", "num_speculative_tokens": k, "prompt_lookup_max": ..., "prompt_lookup_min": ...}` on
`LLM`, `--speculative-config JSON` on `up`, `serve` and `generate` (EngineConfig's
speculative_config holds the JSON text). Torch-free.

Built: `ngram` (prompt lookup: engine/spec/ngram.py) and `suffix` (drafts from the worker's
recent requests too: engine/spec/suffix.py, with suffix_decoding_max_cached_requests and
suffix_decoding_max_spec_factor as vLLM names them). Refused by name, not built yet: `mtp` and
`draft_model` (issue 46). Defaults where the user names none: k = 4, and n-grams of 2
to 4 tokens (vLLM's own defaults differ by version; 2 keeps a single repeated token from
proposing on every step of a chat that copies nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

METHODS = ("ngram", "suffix")
NOT_BUILT = ("mtp", "draft_model", "eagle", "eagle3", "medusa")
# suffix: requests cached (vLLM's default is 10,000 in a tree; an n-gram index per token costs
# more, so fewer here) and the longest draft for a match of n tokens (factor x n)
SUFFIX_CACHED_REQUESTS, SUFFIX_SPEC_FACTOR = 256, 1.0
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    suffix_decoding_max_cached_requests: int = SUFFIX_CACHED_REQUESTS
    suffix_decoding_max_spec_factor: float = SUFFIX_SPEC_FACTOR

    @classmethod
    def parse(cls, value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """The configuration from its JSON text (or a dict, as LLM takes it); None for none.
        ValueError naming the field at fault."""
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                value = orjson.loads(value)
            except orjson.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object, e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: "
                             f"{sorted(known)}")
        method = value.get("method", "ngram")
        if method in NOT_BUILT:
            raise ValueError(f"speculative_config method {method!r} is not built yet; "
                             f"available: {', '.join(METHODS)}")
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}, "
                             f"got {method!r}")
        k = value.get("num_speculative_tokens", 4)
        high = value.get("prompt_lookup_max")
        low = value.get("prompt_lookup_min")
        if high is None:
            high = max(4, low or 0)
        if low is None:
            low = min(2, high)
        for name, v in (("num_speculative_tokens", k), ("prompt_lookup_max", high),
                        ("prompt_lookup_min", low)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config {name} must be an integer >= 1, got {v!r}")
        if k > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens must be <= "
                             f"{MAX_SPECULATIVE_TOKENS}, got {k}")
        if low > high:
            raise ValueError(f"speculative_config prompt_lookup_min ({low}) must be <= "
                             f"prompt_lookup_max ({high})")
        cached = value.get("suffix_decoding_max_cached_requests", SUFFIX_CACHED_REQUESTS)
        factor = value.get("suffix_decoding_max_spec_factor", SUFFIX_SPEC_FACTOR)
        if not isinstance(cached, int) or isinstance(cached, bool) or cached < 0:
            raise ValueError("speculative_config suffix_decoding_max_cached_requests must be an "
                             f"integer >= 0, got {cached!r}")
        if not isinstance(factor, int | float) or isinstance(factor, bool) or factor <= 0:
            raise ValueError("speculative_config suffix_decoding_max_spec_factor must be > 0, "
                             f"got {factor!r}")
        return cls(method, k, high, low, cached, float(factor))

    def text(self) -> str:
        return orjson.dumps(self.__dict__).decode()
