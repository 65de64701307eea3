"""OpenAI response bodies: whole completions, stream chunks, usage, and logprobs rendered from
the workers' compact arrays (token ids and floats) into the chat (`content` entries) or the
completions (`tokens` / `token_logprobs` / `top_logprobs` / `text_offset`) layout."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from evenflow import __version__
from evenflow.proto.sampling import TokenLogprobs
from evenflow.proto.tokenizer import Tokenizer

# One fingerprint per build: what produced the tokens (OpenAI's system_fingerprint).
SYSTEM_FINGERPRINT = f"evenflow-{__version__}"


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    # speculative decoding's draft tokens for this request and those accepted: reported as
    # OpenAI reports Predicted Outputs' (completion_tokens_details accepted_ / rejected_
    # prediction_tokens), only where the worker drafted
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if self.draft_tokens:
            body["completion_tokens_details"] = {
                "accepted_prediction_tokens": self.accepted_draft_tokens,
                "rejected_prediction_tokens": self.draft_tokens - self.accepted_draft_tokens}
        return body


@dataclass(frozen=True)
class TokenLogprob(TokenLogprobs):
    """A token's logprobs (the engine's TokenLogprobs) with what rendering it needs."""

    token_id: int
    previous_id: int  # the token before it: its text depends on it (spaces, merges)


@dataclass
class Piece:
    """What one choice gained from one delta: text, finish reason, and its tokens' logprobs."""

    text: str
    finish: str | None
    logprobs: list[TokenLogprob] = field(default_factory=list)


class LogprobRenderer:
    """Token ids to the text OpenAI shows for them: the text the token adds after the one before
    it (so the chosen tokens' texts concatenate to the output; cached per pair)."""

    CACHE_SIZE = 1 << 16

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._text: dict[tuple[int, int], str] = {}

    def token(self, token_id: int, previous_id: int) -> str:
        key = (previous_id, token_id)
        text = self._text.get(key)
        if text is None:
            before = self._tok.decode([previous_id])
            both = self._tok.decode([previous_id, token_id])
            text = both[len(before):] if both.startswith(before) else ""
            if not text:  # a special token (EOS, say): its own text
                text = self._tok.decode([token_id], skip_special_tokens=False)
            if len(self._text) >= self.CACHE_SIZE:
                self._text.clear()
            self._text[key] = text
        return text

    def chat(self, items: list[TokenLogprob]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float, previous: int) -> dict[str, Any]:
            text = self.token(token_id, previous)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [
            {**entry(t.token_id, t.logprob, t.previous_id),
             "top_logprobs": [entry(i, lp, t.previous_id) for i, lp in zip(
                 t.top_ids, t.top_logprobs, strict=True)]}
            for t in items]}

    def echoed(self, first_prompt_id: int, prompt: list[TokenLogprob],
               output: list[TokenLogprob]) -> dict[str, Any]:
        """echo + logprobs: the prompt's tokens (the first without a logprob, as OpenAI and
        vLLM render it) and then the output's, in the completions layout."""
        head = _first_token_entry(self._tok.decode([first_prompt_id]))  # BOS: ""
        rest = self.completion(prompt + output, len(head["tokens"][0]))
        return {key: head[key] + rest[key] for key in head}

    def completion(self, items: list[TokenLogprob], offset: int) -> dict[str, Any]:
        tokens = [self.token(t.token_id, t.previous_id) for t in items]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": [t.logprob for t in items],
                "top_logprobs": [{self.token(i, t.previous_id): lp for i, lp in zip(
                    t.top_ids, t.top_logprobs, strict=True)} for t in items],
                "text_offset": offsets}


class TokenIdRenderer(LogprobRenderer):
    """Logprobs with each token named "token_id:<id>" (vLLM's return_tokens_as_token_ids):
    exact ids for a client that builds the next prompt from them."""

    def token(self, token_id: int, previous_id: int) -> str:
        return f"token_id:{token_id}"


def _first_token_entry(text: str) -> dict[str, Any]:
    return {"tokens": [text], "token_logprobs": [None], "top_logprobs": [None],
            "text_offset": [0]}


def completion_body(kind: str, request_id: str, model: str, choices: list[dict[str, Any]],
                    usage: Usage) -> dict[str, Any]:
    return {"id": request_id, "created": int(time.time()), "model": model,
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "system_fingerprint": SYSTEM_FINGERPRINT, "choices": choices,
            "usage": usage.body()}


def choice_body(kind: str, index: int, text: str, finish: str | None,
                logprobs: dict[str, Any] | None,
                message: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice of a whole response; `message`: a chat message split into its parts
    (gateway/agent_output.py) instead of `text` as content."""
    choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
    if message is not None:
        choice["message"] = message
    elif kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return choice


def chunk_body(kind: str, request_id: str, model: str, index: int, text: str | None,
               finish: str | None, first: bool, logprobs: dict[str, Any] | None,
               usage: Usage | None = None, created: int | None = None) -> dict[str, Any]:
    """A stream chunk. `created`: the request's (OpenAI's chunks all carry their request's);
    None: now."""
    choice: dict[str, Any]
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else (
            {"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs,
                  "finish_reason": finish}
        obj = "text_completion"
    body = {"id": request_id, "object": obj,
            "created": int(time.time()) if created is None else created, "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT, "choices": [choice]}
    if usage is not None:
        body["usage"] = usage.body()
    return body


class ChunkTemplate:
    """A stream's middle chunk (choice 0, text only, not finished) as bytes, from a template
    made once per stream: the same bytes as `chunk_body` through orjson, with one JSON string
    dump per event instead of a dict."""

    _MARK = "\x01evenflow\x02"

    def __init__(self, kind: str, request_id: str, model: str, created: int) -> None:
        body = orjson.dumps(chunk_body(kind, request_id, model, 0, self._MARK, None, False, None,
                                       created=created))
        head, mark, tail = body.partition(orjson.dumps(self._MARK))
        assert mark and self._MARK.encode() not in tail, "the mark is in the request's names"
        self._head, self._tail = b"data: " + head, tail + b"\n\n"

    def event(self, text: str) -> bytes:
        return self._head + orjson.dumps(text) + self._tail


def delta_chunk(request_id: str, model: str, index: int, delta: dict[str, Any],
                finish: str | None, first: bool, logprobs: dict[str, Any] | None,
                usage: Usage | None = None, created: int | None = None) -> dict[str, Any]:
    """A chat stream chunk whose delta has parts of its own (content, reasoning_content,
    tool_calls: gateway/agent_output.py)."""
    if first:
        delta = {"role": "assistant", **delta}
    body = {"id": request_id, "object": "chat.completion.chunk",
            "created": int(time.time()) if created is None else created, "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage.body()
    return body


def usage_chunk(kind: str, request_id: str, model: str, usage: Usage,
                created: int | None = None) -> dict[str, Any]:
    return {"id": request_id, "created": int(time.time()) if created is None else created,
            "model": model,
            "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "system_fingerprint": SYSTEM_FINGERPRINT, "choices": [], "usage": usage.body()}
