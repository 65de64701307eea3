"""A chat request as an agent sends it, made ready for the model: its messages (assistant turns
with `tool_calls`, `tool` turns answering them) as the chat template expects them, checked
first (a tool message must answer a call made before it), and the shape its output takes
(gateway/agent_output.py): which tool-call and reasoning parsers read it."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import orjson

from evenflow.gateway.agent_output import CallArray, NamedCall, OutputShape
from evenflow.gateway.protocol import APIError, ChatMessage
from evenflow.gateway.reasoning import make_parser as make_reasoning_parser
from evenflow.gateway.structured import ToolRequest
from evenflow.gateway.tool_parsers import PARSERS, ToolParser, detect


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as dicts for the chat template: an assistant turn's tool calls with their
    arguments as objects (what templates render with `tojson`), a tool turn with its call's id
    and function name. Raises APIError naming the message at fault."""
    out: list[dict[str, Any]] = []
    calls: dict[str, str] = {}  # call id -> function name, of the calls made so far
    for i, message in enumerate(messages):
        item: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.tool_calls:
            if message.role != "assistant":
                raise APIError(400, f"messages[{i}]: only assistant messages carry tool_calls",
                               param=f"messages[{i}].tool_calls")
            item["tool_calls"] = [_template_call(i, j, call, calls)
                                  for j, call in enumerate(message.tool_calls)]
        if message.role == "tool":
            if not message.tool_call_id:
                raise APIError(400, f"messages[{i}]: a tool message needs the tool_call_id of "
                               "the call it answers", param=f"messages[{i}].tool_call_id")
            if message.tool_call_id not in calls:
                raise APIError(400, f"messages[{i}].tool_call_id {message.tool_call_id!r} "
                               "answers no call of an earlier assistant message",
                               param=f"messages[{i}].tool_call_id")
            item["tool_call_id"] = message.tool_call_id
            item["name"] = message.name or calls[message.tool_call_id]
        elif message.name:
            item["name"] = message.name
        out.append(item)
    return out


def _template_call(i: int, j: int, call: Any, calls: dict[str, str]) -> dict[str, Any]:
    param = f"messages[{i}].tool_calls[{j}]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f"{param} must be {{\"id\": ..., \"type\": \"function\", "
                       "\"function\": {\"name\": ..., \"arguments\": \"{...}\"}}", param=param)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments or "{}")
        except orjson.JSONDecodeError:
            raise APIError(400, f"{param}.function.arguments is not valid JSON",
                           param=f"{param}.function.arguments") from None
    call_id = call.get("id") or f"call_{i}_{j}"
    calls[str(call_id)] = function["name"]
    return {"id": call_id, "type": "function",
            "function": {"name": function["name"], "arguments": arguments},
            # (Hermes-style templates read these at the top level)
            "name": function["name"], "arguments": arguments}


def tool_parser_name(configured: str, chat_template: str | None) -> str:
    """The parser "auto" reads the model's output with: the configured one, else the one the
    chat template's syntax calls for, else hermes (`<tool_call>`, the most common)."""
    return configured or detect(chat_template) or "hermes"


def output_shape(tools: ToolRequest | None, tool_parser: str, reasoning_parser: str
                 ) -> OutputShape | None:
    """How a chat job's output splits (None: all of it is content)."""
    tools_factory: Callable[[], ToolParser] | None = None
    if tools is not None:
        if tools.named is not None:
            tools_factory = functools.partial(NamedCall, tools.named)
        elif tools.schema is not None:
            tools_factory = CallArray
        else:
            tools_factory = PARSERS[tool_parser]
    reasoning_factory = functools.partial(make_reasoning_parser, reasoning_parser) \
        if reasoning_parser else None
    if tools_factory is None and reasoning_factory is None:
        return None
    special = (tools is not None and tools.schema is None
               and PARSERS[tool_parser].needs_special_tokens) or (
        reasoning_factory is not None and reasoning_factory().needs_special_tokens)
    return OutputShape(tools_factory, reasoning_factory, special)

