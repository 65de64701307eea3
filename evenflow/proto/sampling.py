"""SamplingParams: what the caller asks of one request's generation — the one sampling type,
from the HTTP body (gateway/protocol.py `to_sampling_params`) or the offline API, over the wire
inside the request messages (proto/codec.py carries it as it is), to the engine's sampler.
Checked in one place, on construction: a value out of range is a ValueError naming the field
(the gateway answers 400 with it; the codec drops a message carrying one, and counts it).
Torch-free, as everything in proto/.

Adding a field takes three files: this one (the field and its check), the HTTP body that sets
it (gateway/protocol.py) and the code that uses it (engine/sample/)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k <= 0 and top_p == 1 disable those filters.

    stop_token_ids end a sequence (finish reason "stop") even with ignore_eos; stop strings are
    matched on the detokenized text by the caller that owns the tokenizer (the offline `LLM` or
    the gateway), never by the engine. Sequences given as lists (or a dict for logit_bias, a
    string for stop) are stored as tuples.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output
    min_tokens: int = 0  # EOS and stop tokens are masked until this many output tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    allowed_token_ids: tuple[int, ...] | None = None  # None: every token
    logprobs: int | None = None  # how many top logprobs per token (0: the chosen one only)
    # the same for every prompt token after the first (computed, never taken from the cache)
    prompt_logprobs: int | None = None
    # structured output: an llguidance grammar text (proto/grammar.py guide_grammar makes one
    # from a JSON schema, regex, choice list or Lark grammar); the output matches it
    guide: str | None = None
    # the prompt's last N tokens are this request's own earlier output (a retried request):
    # its grammar consumes them before the first new token
    resumed_output_tokens: int = 0
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    # vLLM's meaning: lower is sooner. The gateway's admission queue and the engine's waiting
    # queue take requests in this order (aged, so nothing starves), and under memory pressure
    # the engine preempts the running request of the highest value first.
    priority: int = 0
    # a LoRA adapter (engine/model/lora.py): its name, and the PEFT checkpoint any worker loads
    # it from (the request carries both, so it survives a hand-off or a migration)
    lora_name: str = ""
    lora_path: str = ""

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ValueError(f"SamplingParams.{name} {message}")

        def number(value: Any) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        def integer(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        check(number(self.temperature) and self.temperature >= 0,
              "temperature", f"must be >= 0, got {self.temperature!r}")
        check(number(self.top_p) and 0 < self.top_p <= 1,
              "top_p", f"must be in (0, 1], got {self.top_p!r}")
        check(integer(self.top_k) and (self.top_k == -1 or self.top_k >= 0),
              "top_k", f"must be -1 (off), 0 (off) or a positive int, got {self.top_k!r}")
        check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a bool")
        check(isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output",
              "must be a bool")
        check(integer(self.max_tokens) and self.max_tokens >= 1,
              "max_tokens", f"must be an int >= 1, got {self.max_tokens!r}")
        check(self.seed is None or (integer(self.seed) and -(1 << 63) <= self.seed < (1 << 63)),
              "seed", f"must be a 64-bit int or None, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        check(all(isinstance(s, str) for s in stop), "stop", "must be strings")
        self._set("stop", stop)
        stop_ids = tuple(self.stop_token_ids)
        check(all(integer(t) and t >= 0 for t in stop_ids),
              "stop_token_ids", "must be non-negative ints")
        self._set("stop_token_ids", stop_ids)
        check(number(self.min_p) and 0 <= self.min_p <= 1,
              "min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(number(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}")
        check(number(self.repetition_penalty) and self.repetition_penalty > 0,
              "repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        check(integer(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
              "min_tokens", f"must be in [0, max_tokens], got {self.min_tokens!r}")
        try:
            bias = _bias_pairs(self.logit_bias)
        except (TypeError, ValueError):
            bias = None
        check(bias is not None and all(t >= 0 and -100 <= b <= 100 for t, b in bias),
              "logit_bias", "must map token ids >= 0 to values in [-100, 100]")
        self._set("logit_bias", bias)
        if self.allowed_token_ids is not None:
            allowed = tuple(self.allowed_token_ids)
            check(len(allowed) > 0 and all(integer(t) and t >= 0 for t in allowed),
                  "allowed_token_ids", "must be a non-empty list of token ids")
            self._set("allowed_token_ids", allowed)
        check(self.guide is None or isinstance(self.guide, str), "guide",
              "must be a grammar string or None")
        check(integer(self.resumed_output_tokens) and self.resumed_output_tokens >= 0,
              "resumed_output_tokens", "must be an int >= 0")
        check(integer(self.priority) and -(1 << 31) <= self.priority < (1 << 31), "priority",
              f"must be a 32-bit int, got {self.priority!r}")
        check(isinstance(self.lora_name, str) and isinstance(self.lora_path, str)
              and (bool(self.lora_name) or not self.lora_path), "lora_name",
              "and lora_path must be strings (a path needs a name)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or (integer(value) and 0 <= value <= MAX_LOGPROBS), name,
                  f"must be None or in [0, {MAX_LOGPROBS}]")

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processes_logits(self) -> bool:
        """Whether anything but temperature / top-k / top-p / min-p changes the logits
        (engine/sample/logits_processing.py)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.min_tokens or self.logit_bias
                    or self.allowed_token_ids)


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's logprobs, the one form from the sampler to the renderer (the engine's
    outputs, the expert-parallel ranks' wire; TokenDelta flattens a step's into lists): the
    chosen token's logprob and the top ones, best first (ids and values)."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


def _bias_pairs(bias: Mapping[Any, Any] | Iterable[Any]) -> tuple[tuple[int, float], ...]:
    """{token: bias} or [(token, bias), ...] -> ((token, bias), ...), token ids as ints (a
    float that is a whole number is taken: JSON numbers)."""
    items = bias.items() if isinstance(bias, Mapping) else bias
    pairs = []
    for token, value in items:
        if isinstance(token, bool) or isinstance(value, bool) or int(token) != token:
            raise ValueError(token)
        pairs.append((int(token), float(value)))
    return tuple(pairs)
