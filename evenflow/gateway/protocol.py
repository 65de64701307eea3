"""The OpenAI-compatible HTTP contract: request models (validated at the edge with pydantic)
and OpenAI-style error bodies.

Every field of OpenAI's API (and of vLLM's extras) is either applied or, set to anything but its
neutral value, refused with a 400 naming it (`NOT_SUPPORTED`; README "API fields"). Keys that
are neither (other vendors' extras) are ignored, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from evenflow.proto.sampling import SamplingParams


class APIError(Exception):
    """An error answered as {"error": {message, type, param, code}} with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# Edge limits (README "Limits"): what one request may ask for, before any work is done.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_TOKENS_LIMIT = 1 << 20  # the context check comes later; this bounds the number itself
INT64 = (-(1 << 63), (1 << 63) - 1)
Number = StrictFloat | StrictInt  # a JSON number; "0.5" (a string) is a 400, not a coercion


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # usage in every chunk (vLLM)


MAX_CHOICES = 16  # n


def _none(v: Any) -> bool:
    return v is None


def _empty(v: Any) -> bool:
    return not v


def _one_of(*neutral: Any) -> Callable[[Any], bool]:
    return lambda v: any(v == n and type(v) is type(n) for n in neutral) or v is None


# Fields of OpenAI's API and vLLM's extras that evenflow does not implement, each with what its
# neutral value is: set to anything else, the request is refused with 400 naming the field.
NOT_SUPPORTED: dict[str, Callable[[Any], bool]] = {
    # (tools on the completions endpoint; chat applies them)
    "tools": _empty, "tool_choice": _one_of("none"), "functions": _empty,
    "function_call": _one_of("none"), "suffix": _empty, "echo": _one_of(False),
    "prompt_logprobs": _none, "use_beam_search": _one_of(False), "length_penalty": _one_of(1, 1.0),
    "audio": _none, "modalities": lambda v: v is None or v == ["text"], "prediction": _none,
    "web_search_options": _none, "reasoning_effort": _none, "store": _one_of(False),
    "metadata": _empty, "logits_processors": _empty, "bad_words": _empty,
    "continue_final_message": _one_of(False), "chat_template": _none,
    "chat_template_kwargs": _empty, "documents": _empty, "truncate_prompt_tokens": _none,
    "skip_special_tokens": _one_of(True),
    "spaces_between_special_tokens": _one_of(True),
    "service_tier": _one_of("auto", "default"), "mm_processor_kwargs": _empty,
}


class _Common(BaseModel):
    """Fields both endpoints take, with their types and ranges checked strictly (no coercion
    from strings): a bad value is a 400 naming the field."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, ge=0, le=MAX_TOKENS_LIMIT)  # 0: echo
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: Number = Field(default=1.0, ge=0, le=2)
    top_p: Number = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt = Field(default=-1, ge=-1, le=(1 << 31) - 1)  # > vocab: all tokens
    seed: StrictInt | None = Field(default=None, ge=INT64[0], le=INT64[1])
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] = Field(
        default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHOICES)
    best_of: StrictInt | None = Field(default=None, ge=1, le=MAX_CHOICES)  # = n (no ranking)
    ignore_eos: StrictBool = False
    include_stop_str_in_output: StrictBool = False
    # vLLM's: lower is sooner, at the gateway's admission queue and the engine's waiting queue
    priority: StrictInt = Field(default=0, ge=-(1 << 31), lt=1 << 31)
    # vLLM's: logprobs name each token "token_id:<id>" instead of its text
    return_tokens_as_token_ids: StrictBool = False
    min_p: Number = Field(default=0.0, ge=0, le=1)
    presence_penalty: Number = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: Number = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: Number = Field(default=1.0, gt=0, le=10)
    min_tokens: StrictInt = Field(default=0, ge=0, le=MAX_TOKENS_LIMIT)
    allowed_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = Field(
        default=None, min_length=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # Seconds this request may take in all (vLLM-style extra field); the server's
    # EVENFLOW_REQUEST_TIMEOUT_S caps it. Past it: 504 (an error event once streaming).
    timeout: Number | None = Field(default=None, gt=0)
    logit_bias: dict[str, Annotated[Number, Field(ge=-100, le=100)]] | None = None
    # Structured output (gateway/structured.py): at most one of these per request
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = Field(default=None, min_length=1)
    guided_choice: list[StrictStr] | None = Field(default=None, min_length=1)
    guided_grammar: StrictStr | None = Field(default=None, min_length=1)
    guided_decoding_backend: StrictStr | None = None  # accepted; llguidance serves them all
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, neutral in NOT_SUPPORTED.items():
                if name in data and name not in cls.model_fields and not neutral(data[name]):
                    # (raised as is: pydantic would lose which field it was)
                    raise APIError(400, f"{name}: {name} is not supported by evenflow",
                                   param=name)
        return data

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("best_of must equal n (choices are not ranked)")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise ValueError(f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v and not all(k.isdigit() for k in v):
            raise ValueError("logit_bias keys must be token ids")
        return v

    @property
    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items())

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: StreamOptions | None,
                                    info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream: true")
        return v

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    @property
    def top_logprobs_wanted(self) -> int | None:
        raise NotImplementedError  # (each request type names its own field)

    def to_sampling_params(self, max_tokens: int, echo: bool = False) -> SamplingParams:
        """The request's sampling as the engine takes it and the wire carries it (the one place
        it is built, as vLLM's to_sampling_params); ValueError names a field out of range.
        max_tokens: as the gateway settled it against the context; echo: the prompt's logprobs
        too (completions)."""
        logprobs = self.top_logprobs_wanted
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            max_tokens=max_tokens, stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos, min_p=self.min_p, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_tokens=self.min_tokens,
            logit_bias=self.bias_pairs,
            allowed_token_ids=tuple(self.allowed_token_ids) if self.allowed_token_ids else None,
            logprobs=logprobs, prompt_logprobs=logprobs if echo else None,
            stop=tuple(self.stop_strings),
            include_stop_str_in_output=self.include_stop_str_in_output, priority=self.priority)


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt] | list[StrictStr]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)  # top N per token
    add_special_tokens: StrictBool = True
    # The prompt in front of the completion, with its logprobs when logprobs is set (as
    # lm-eval's loglikelihood requests use it, max_tokens 0 included)
    echo: StrictBool = False

    @field_validator("echo")
    @classmethod
    def _echo_not_streamed(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("stream"):
            raise ValueError("echo is not supported with stream: true")
        return v

    @property
    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str]) -> str | list[int]:
        if isinstance(v, str):
            return v
        if not v:
            raise ValueError("prompt must not be empty")
        texts = [x for x in v if isinstance(x, str)]
        if texts:
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            return texts[0]
        return [x for x in v if isinstance(x, int)]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | list[dict[str, Any]] | None = None
    # an assistant turn's calls, and a tool turn's answer to one (gateway/agent_input.py)
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    # Tool calls (gateway/structured.py, agent_output.py): "auto" (the default with tools)
    # reads the model's own syntax; "required" and a named function are forced by a grammar
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None  # False: "required" makes one call at most
    add_special_tokens: StrictBool = False
    # extra variables for the chat template (Qwen3's enable_thinking, say), as vLLM takes them
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @property
    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """POST /tokenize: `prompt` (completions) or `messages` (chat, template applied)."""

    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class LoadLoRARequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's): serve a PEFT checkpoint under a name."""

    model_config = ConfigDict(extra="ignore")
    lora_name: StrictStr
    lora_path: StrictStr


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: StrictStr


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    tokens: list[StrictInt] = Field(max_length=1 << 20)


_BRANCHES = {"str", "int", "float", "bool", "dict", "list", "none"}
_WHERE = {"body", "query", "path", "header", "cookie"}  # FastAPI's first element of a loc
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number",
               float: "a number", bool: "a boolean", type(None): "null"}


def param_name(loc: tuple[Any, ...]) -> str | None:
    """pydantic's error location as OpenAI names a parameter (`messages[0].content`): without
    FastAPI's leading "body" (or "query", ...) and without the union branch pydantic tried
    ("float", "list[int]")."""
    name = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            name += f"[{part}]"
        elif not ((i == 0 and part in _WHERE) or part in _BRANCHES or "[" in part):
            name += f".{part}" if name else str(part)
    return name or None


def _sentence(msg: str) -> str:
    """pydantic's message as the tail of ours: no "Value error, " prefix, lower-case start."""
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    return msg[0].lower() + msg[1:] if msg[1:2].islower() else msg


def validation_error(exc: Exception, body_model: type[BaseModel] | None = None) -> APIError:
    """pydantic's ValidationError (FastAPI's RequestValidationError) as a 400 naming the first
    bad field, OpenAI's way: `param` is the field (`messages[0].role`), the message names it,
    `code` is missing_required_parameter / invalid_type / invalid_value. `body_model` (the
    endpoint's request model) names the first required field when the body is empty."""
    errors: list[dict[str, Any]] = getattr(exc, "errors", lambda: [])()
    if not errors:
        return APIError(400, str(exc))
    first = errors[0]
    kind, loc = first.get("type", ""), tuple(first.get("loc", ()))
    if kind == "json_invalid":
        at = f" (at character {loc[1]})" if len(loc) > 1 and isinstance(loc[1], int) else ""
        return APIError(400, "We could not parse the JSON body of your request: "
                        f"{first.get('ctx', {}).get('error', 'invalid JSON')}{at}.",
                        code="invalid_json")
    param = param_name(loc)
    if param is None and kind == "missing":  # no body at all
        required = [name for name, field in (body_model.model_fields.items() if body_model
                                             else ()) if field.is_required()]
        if not required:
            return APIError(400, "The request body is empty: a JSON object is required.",
                            code="missing_required_parameter")
        listed = " and ".join(f"'{name}'" for name in required)
        return APIError(400, f"The request body is empty: missing required parameter "
                        f"'{required[0]}' (a JSON object with {listed} is required).",
                        param=required[0], code="missing_required_parameter")
    if param is None and kind.endswith("_type"):  # the body is not a JSON object
        value = first.get("input")
        if isinstance(value, bytes):  # not parsed: sent as something other than JSON
            return APIError(400, "The request body must be a JSON object sent with "
                            "Content-Type: application/json.", code="invalid_type")
        return APIError(400, "The request body must be a JSON object, not "
                        f"{_JSON_TYPES.get(type(value), type(value).__name__)}.",
                        code="invalid_type")
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param,
                        code="missing_required_parameter")
    if param is None:  # a check of the whole body (two fields that exclude each other)
        return APIError(400, _sentence(first.get("msg", "")), code="invalid_value")
    if kind.endswith("_type"):  # each union branch pydantic tried, in one sentence
        wanted = list(dict.fromkeys(
            _sentence(e.get("msg", "")).removeprefix("input should be ") for e in errors
            if param_name(tuple(e.get("loc", ()))) == param and e.get("type", "").endswith(
                "_type")))
        return APIError(400, f"Invalid type for '{param}': expected {' or '.join(wanted)}.",
                        param=param, code="invalid_type")
    return APIError(400, f"Invalid value for '{param}': {_sentence(first.get('msg', ''))}",
                    param=param, code="invalid_value")
