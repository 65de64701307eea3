"""SamplingParams: what the caller asks of one request's generation, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k <= 0 and top_p == 1 disable those filters.

    stop_token_ids end a sequence (finish reason "stop") even with ignore_eos; stop strings are
    matched on the detokenized text by the caller that owns the tokenizer (the offline `LLM` or
    the gateway), never by the engine.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] | list[str] = field(default=())
    stop_token_ids: tuple[int, ...] | list[int] = field(default=())
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ValueError(f"SamplingParams.{name} {message}")

        check(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
              "temperature", f"must be >= 0, got {self.temperature!r}")
        check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
              "top_p", f"must be in (0, 1], got {self.top_p!r}")
        check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0),
              "top_k", f"must be -1 (off), 0 (off) or a positive int, got {self.top_k!r}")
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a bool")
        check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
              "max_tokens", f"must be an int >= 1, got {self.max_tokens!r}")
        check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                    and -(1 << 63) <= self.seed < (1 << 63)),
              "seed", f"must be a 64-bit int or None, got {self.seed!r}")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        check(all(isinstance(s, str) for s in stop), "stop", "must be strings")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids", "must be non-negative ints")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
