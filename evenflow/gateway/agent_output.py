"""One chat choice's output as an assistant message in parts: `content`, `reasoning_content` and
`tool_calls`, from the text as it grows. Streamed, each new piece becomes the deltas it adds: a
call's index, id and name once, then its arguments in pieces; whole, the message at the end.

Where the parts come from:
- a forced call (gateway/structured.py): `tool_choice` naming a function makes the output that
  function's arguments (`NamedCall`); "required" makes it a JSON array of calls (`CallArray`),
  and only complete calls count, so an array cut by max_tokens comes back as the calls that
  were complete (finish "length"), never as array text in `content`; streamed, each of those
  calls goes out whole as soon as it closes;
- "auto": the model's own syntax, read by its family's parser (gateway/tool_parsers.py);
- reasoning: `--reasoning-parser` (gateway/reasoning.py), applied before the tool parser."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from evenflow.gateway.reasoning import ReasoningParser
from evenflow.gateway.tool_parsers import (
    Call,
    HarmonyParser,
    Parsed,
    ToolParser,
    call_from_object,
    skip_ws,
    value_end,
)


class NamedCall(ToolParser):
    """The whole output is the named function's arguments (a JSON object)."""

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_ws(text, 0)
        complete = start < len(text) and value_end(text, start) is not None
        return Parsed(calls=[Call(self.function, text[start:], complete)])


class CallArray(ToolParser):
    """The output is a JSON array of {"name", "parameters"} calls; only complete ones count."""

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = Parsed()
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return parsed
        i = skip_ws(text, i + 1)
        while i < len(text) and text[i] == "{":
            call, end = call_from_object(text, i, ("parameters", "arguments"))
            if call is None or end is None or not call.complete:
                break
            parsed.calls.append(call)
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ",":
                i = skip_ws(text, i + 1)
        return parsed


@dataclass(frozen=True)
class OutputShape:
    """How a job's choices split their text (None: plain content, the usual path)."""

    tools: Callable[[], ToolParser] | None = None
    reasoning: Callable[[], ReasoningParser] | None = None
    needs_special_tokens: bool = False  # the parsers' markers are special tokens

    def split(self) -> OutputSplit:
        return OutputSplit(self.tools() if self.tools else None,
                           self.reasoning() if self.reasoning else None)


class OutputSplit:
    def __init__(self, tools: ToolParser | None, reasoning: ReasoningParser | None) -> None:
        self.tools, self.reasoning = tools, reasoning
        self.text = ""
        self.parsed = Parsed()
        self._sent_content = self._sent_reasoning = 0
        self._sent_calls: list[list[Any]] = []  # per call: [id, arguments sent]

    def _parse(self, final: bool) -> Parsed:
        text, reasoning = self.text, ""
        if self.reasoning is not None and not isinstance(self.tools, HarmonyParser):
            reasoning, text = self.reasoning.split(text, final)
        parsed = self.tools.parse(text, final) if self.tools is not None else Parsed(text)
        parsed.reasoning = reasoning + parsed.reasoning
        return parsed

    def feed(self, piece: str, final: bool = False) -> dict[str, Any] | None:
        """The delta `piece` adds (None: nothing yet); `final` once the output has ended."""
        self.text += piece
        parsed = self.parsed = self._parse(final)
        delta: dict[str, Any] = {}
        if len(parsed.reasoning) > self._sent_reasoning:
            delta["reasoning_content"] = parsed.reasoning[self._sent_reasoning:]
            self._sent_reasoning = len(parsed.reasoning)
        if len(parsed.content) > self._sent_content:
            delta["content"] = parsed.content[self._sent_content:]
            self._sent_content = len(parsed.content)
        calls = []
        for i, call in enumerate(parsed.calls):
            if call.name is None:
                break  # (in order: the next waits for this one's name)
            if i == len(self._sent_calls):
                self._sent_calls.append([_call_id(), len(call.arguments)])
                calls.append({"index": i, "id": self._sent_calls[i][0], "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > self._sent_calls[i][1]:
                calls.append({"index": i, "function": {
                    "arguments": call.arguments[self._sent_calls[i][1]:]}})
                self._sent_calls[i][1] = len(call.arguments)
        if calls:
            delta["tool_calls"] = calls
        return delta or None

    def finish_reason(self, finish: str | None) -> str | None:
        """A choice that ended by itself after calls finishes with "tool_calls"."""
        has_calls = bool(self.parsed.calls) and self.parsed.calls[0].name is not None
        return "tool_calls" if finish == "stop" and has_calls else finish

    def tool_calls(self) -> list[dict[str, Any]]:
        calls = []
        for i, call in enumerate(self.parsed.calls):
            if call.name is None:
                break
            call_id = self._sent_calls[i][0] if i < len(self._sent_calls) else _call_id()
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": call.name, "arguments": call.arguments}})
        return calls

    def message(self) -> dict[str, Any]:
        """The whole assistant message (after the final `feed`)."""
        calls = self.tool_calls()
        message: dict[str, Any] = {"role": "assistant",
                                   "content": self.parsed.content or (None if calls else "")}
        if self.reasoning is not None or self.parsed.reasoning:
            message["reasoning_content"] = self.parsed.reasoning or None
        if calls:
            message["tool_calls"] = calls
        return message


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"
