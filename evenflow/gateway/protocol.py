"""The OpenAI-compatible HTTP contract: request models (validated at the edge with pydantic,
unknown fields ignored) and OpenAI-style error bodies."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    n: int = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> list[str]:
        if v is None:
            return []
        return [v] if isinstance(v, str) else v

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]

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
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True


def validation_error(exc: Exception) -> APIError:
    """pydantic's ValidationError as a 400 naming the first bad field."""
    errors: list[dict[str, Any]] = getattr(exc, "errors", lambda: [])()
    if errors and errors[0].get("type") == "json_invalid":
        return APIError(400, "We could not parse the JSON body of your request: "
                             f"{errors[0].get('ctx', {}).get('error', 'invalid JSON')}")
    if errors:
        first = errors[0]
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return APIError(400, f"{param}: {first.get('msg')}" if param else first.get("msg", ""),
                        param=param)
    return APIError(400, str(exc))
