"""The OpenAI-compatible HTTP contract: request models (validated at the edge with pydantic,
unknown fields ignored) and OpenAI-style error bodies."""

from __future__ import annotations

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
)


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


class _Common(BaseModel):
    """Fields both endpoints take, with their types and ranges checked strictly (no coercion
    from strings): a bad value is a 400 naming the field."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: Number = Field(default=1.0, ge=0, le=2)
    top_p: Number = Field(default=1.0, gt=0, le=1)
    top_k: StrictInt = Field(default=-1, ge=-1, le=(1 << 31) - 1)  # > vocab: all tokens
    seed: StrictInt | None = Field(default=None, ge=INT64[0], le=INT64[1])
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] = Field(
        default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    n: StrictInt = Field(default=1, ge=1, le=1)
    best_of: StrictInt | None = Field(default=None, ge=1, le=1)
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # Seconds this request may take in all (vLLM-style extra field); the server's
    # EVENFLOW_REQUEST_TIMEOUT_S caps it. Past it: 504 (an error event once streaming).
    timeout: Number | None = Field(default=None, gt=0)
    # Accepted as OpenAI clients send them, refused when they ask for what is not built yet.
    logit_bias: dict[str, Number] | None = None

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
    def _no_logit_bias(cls, v: dict[str, float] | None) -> None:
        if v:
            raise ValueError("logit_bias is not supported")
        return None

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
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt] | list[StrictStr]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=0)  # not built yet: only 0
    echo: StrictBool = Field(default=False)
    suffix: StrictStr | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> None:
        if v:
            raise ValueError("suffix is not supported")
        return None

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

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("logprobs are not supported yet")
        return v


_BRANCHES = {"str", "int", "float", "bool", "dict", "list", "none"}


def validation_error(exc: Exception) -> APIError:
    """pydantic's ValidationError as a 400 naming the first bad field."""
    errors: list[dict[str, Any]] = getattr(exc, "errors", lambda: [])()
    if errors and errors[0].get("type") == "json_invalid":
        return APIError(400, "We could not parse the JSON body of your request: "
                             f"{errors[0].get('ctx', {}).get('error', 'invalid JSON')}")
    if errors:
        first = errors[0]
        # The location without "body" and without the union branch pydantic tried ("float").
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body" and not (
            isinstance(p, str) and (p in _BRANCHES or "[" in p))) or None
        return APIError(400, f"{param}: {first.get('msg')}" if param else first.get("msg", ""),
                        param=param)
    return APIError(400, str(exc))
