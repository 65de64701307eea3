"""SamplingParams: what the caller asks of one request's generation, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from evenflow.proto.messages import SamplingSpec


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
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output
    min_tokens: int = 0  # EOS and stop tokens are masked until this many output tokens
    logit_bias: tuple[tuple[int, float], ...] | dict[int, float] = field(default=())
    allowed_token_ids: tuple[int, ...] | list[int] | None = None
    logprobs: int | None = None  # how many top logprobs per token (0: the chosen one only)
    # the same for every prompt token after the first (computed, never taken from the cache)
    prompt_logprobs: int | None = None
    # structured output: an llguidance grammar text (evenflow.proto.grammar.guide_grammar makes
    # one from a JSON schema, regex, choice list or Lark grammar); the output matches it
    guide: str | None = None
    # the prompt's last N tokens are this request's own earlier output (a retried request):
    # its grammar consumes them before the first new token
    resumed_output_tokens: int = 0

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
        check(isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1,
              "min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(isinstance(value, (int, float)) and -2 <= value <= 2, name,
                  f"must be in [-2, 2], got {value!r}")
        check(isinstance(self.repetition_penalty, (int, float)) and self.repetition_penalty > 0,
              "repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
              "min_tokens", f"must be in [0, max_tokens], got {self.min_tokens!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        bias = tuple((int(t), float(b)) for t, b in bias)
        check(all(t >= 0 and -100 <= b <= 100 for t, b in bias), "logit_bias",
              "must map token ids >= 0 to values in [-100, 100]")
        object.__setattr__(self, "logit_bias", bias)
        if self.allowed_token_ids is not None:
            check(len(self.allowed_token_ids) > 0 and all(
                isinstance(t, int) and t >= 0 for t in self.allowed_token_ids),
                "allowed_token_ids", "must be a non-empty list of token ids")
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        check(self.guide is None or isinstance(self.guide, str), "guide",
              "must be a grammar string or None")
        check(isinstance(self.resumed_output_tokens, int) and self.resumed_output_tokens >= 0,
              "resumed_output_tokens", "must be an int >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or (isinstance(value, int) and 0 <= value <= 20), name,
                  "must be None or in [0, 20]")

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


def sampling_params_of(params: SamplingParams | SamplingSpec) -> SamplingParams:
    """Wire settings (proto SamplingSpec) -> validated SamplingParams (ValueError naming the
    field); SamplingParams pass through."""
    if isinstance(params, SamplingParams):
        return params
    return SamplingParams(temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k, seed=params.seed, max_tokens=params.max_tokens,
                          stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
                          min_p=params.min_p, presence_penalty=params.presence_penalty,
                          frequency_penalty=params.frequency_penalty,
                          repetition_penalty=params.repetition_penalty,
                          min_tokens=params.min_tokens,
                          logit_bias=tuple((int(t), b) for t, b in params.logit_bias),
                          allowed_token_ids=params.allowed_token_ids or None,
                          logprobs=None if params.logprobs < 0 else params.logprobs,
                          prompt_logprobs=None if params.prompt_logprobs < 0
                          else params.prompt_logprobs, guide=params.guide or None,
                          resumed_output_tokens=params.resumed_output_tokens)


def spec_of(params: SamplingParams) -> SamplingSpec:
    """The wire form of the token-level settings (stop strings stay with the caller): the
    inverse of sampling_params_of, for a rank that hands a request to another rank."""
    bias = params.logit_bias.items() if isinstance(params.logit_bias, dict) else params.logit_bias
    return SamplingSpec(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                        seed=params.seed, max_tokens=params.max_tokens,
                        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
                        min_p=params.min_p, presence_penalty=params.presence_penalty,
                        frequency_penalty=params.frequency_penalty,
                        repetition_penalty=params.repetition_penalty,
                        min_tokens=params.min_tokens,
                        logit_bias=[[float(t), float(b)] for t, b in bias],
                        allowed_token_ids=list(params.allowed_token_ids or []),
                        logprobs=-1 if params.logprobs is None else params.logprobs,
                        prompt_logprobs=-1 if params.prompt_logprobs is None
                        else params.prompt_logprobs, guide=params.guide or "",
                        resumed_output_tokens=params.resumed_output_tokens)
