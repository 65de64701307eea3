"""The speculative decoding configuration, as vLLM takes it: `speculative_config={"method":
"ngram", "num_speculative_tokens": k, "prompt_lookup_max": ..., "prompt_lookup_min": ...}` on
`LLM`, `--speculative-config JSON` on `up`, `serve` and `generate` (EngineConfig's
speculative_config holds the JSON text). Torch-free.

Methods: `ngram` (prompt lookup: engine/spec/ngram.py); `suffix` (drafts from the worker's
recent requests too: engine/spec/suffix.py, with suffix_decoding_max_cached_requests and
suffix_decoding_max_spec_factor as vLLM names them); `draft_model` (a smaller model with the
same tokenizer, `"model": path`, as vLLM takes it; a config with a model and no method is this
one) and `mtp` (the checkpoint's own next-token layers, DeepSeek-V3's
num_nextn_predict_layers; vLLM's older name `deepseek_mtp` is taken too): both drafted greedily
by engine/serving/draft_model.py. Refused by name: eagle, eagle3, medusa. Defaults where the user
names none: k = 4 (1 for mtp, as DeepSeek trained its layer), and n-grams of 2 to 4 tokens
(vLLM's own defaults differ by version; 2 keeps a single repeated token from proposing on every
step of a chat that copies nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

METHODS = ("ngram", "suffix", "draft_model", "mtp")
ALIASES = {"deepseek_mtp": "mtp"}
NOT_BUILT = ("eagle", "eagle3", "medusa")
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
    model: str | None = None  # draft_model: the draft's checkpoint (a path or a built-in name)

    @property
    def drafts_with_a_model(self) -> bool:
        return self.method in ("draft_model", "mtp")

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
                 "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
                 "model"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: "
                             f"{sorted(known)}")
        model = value.get("model")
        method = value.get("method", "draft_model" if model is not None else "ngram")
        method = ALIASES.get(method, method)
        if method in NOT_BUILT:
            raise ValueError(f"speculative_config method {method!r} is not built yet; "
                             f"available: {', '.join(METHODS)}")
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(METHODS)}, "
                             f"got {method!r}")
        if method == "draft_model" and (not isinstance(model, str) or not model):
            raise ValueError('speculative_config method "draft_model" needs "model": the draft '
                             "checkpoint's path or name")
        if model is not None and method != "draft_model":
            raise ValueError(f'speculative_config "model" is for method "draft_model", not '
                             f"{method!r}")
        k = value.get("num_speculative_tokens", 1 if method == "mtp" else 4)
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
        return cls(method, k, high, low, cached, float(factor), model)

    def text(self) -> str:
        return orjson.dumps(self.__dict__).decode()
