"""Structured output and tool calls at the gateway: which output format a request asks for
(`response_format`, vLLM's `guided_*` / `structured_outputs` extras, or `tools` with a
`tool_choice` that forces a call), its grammar compiled and validated against the model's
vocabulary off the event loop (a bad schema is a 400 before any work).

Forced tool calls go through the same constrained decoding, as vLLM does without a
model-specific parser: `tool_choice: {"type": "function", ...}` makes the output that
function's arguments (a JSON object matching its `parameters`); `"required"` makes it a JSON
array of `{"name", "parameters"}` calls, one of the tools each: at most one with
`parallel_tool_calls: false`, otherwise at most MAX_PARALLEL_CALLS (enough for an agent's
fan-out, and a bound on a model that would add calls until max_tokens). `"auto"` (also the
default when `tools` are given) constrains nothing: the model's own tool syntax is read back by
its family's parser (gateway/tool_parsers.py). The output becomes `tool_calls` in
gateway/agent_output.py.
"""

from __future__ import annotations

import asyncio
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from evenflow.gateway.protocol import APIError, ChatCompletionRequest, CompletionRequest
from evenflow.proto.grammar import GrammarError, guide_grammar, guide_vocabulary, validate

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


MAX_PARALLEL_CALLS = 8


@dataclass(frozen=True)
class ToolRequest:
    """What a request's tools ask of the output: `schema` (a forced call's grammar: the named
    function's arguments, or "required"'s array of calls) or, with schema None, "auto"."""

    schema: dict[str, Any] | None
    named: str | None = None


def _loads(value: Any, param: str) -> Any:
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError as exc:
            raise APIError(400, f"{param}: not valid JSON ({exc})", param=param) from None
    return value


def requested_format(req: CompletionRequest | ChatCompletionRequest) -> tuple[str, Any, str] | None:
    """(guide kind, value, the field that asked) for the output format the request names, or
    None; a request may name at most one."""
    found: list[tuple[str, Any, str]] = []
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            found.append(("json_object", None, "response_format"))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema", {"type": "object"}) if isinstance(spec, dict) else None
            if not isinstance(schema, (dict, str)):
                raise APIError(400, "response_format.json_schema must be an object with a "
                               "`schema`", param="response_format")
            found.append(("json_schema", _loads(schema, "response_format"), "response_format"))
        elif kind != "text":
            raise APIError(400, f"response_format: type {kind!r} is not supported (text, "
                           "json_object or json_schema)", param="response_format")
    if req.guided_json is not None:
        found.append(("json_schema", _loads(req.guided_json, "guided_json"), "guided_json"))
    if req.guided_regex is not None:
        found.append(("regex", req.guided_regex, "guided_regex"))
    if req.guided_choice is not None:
        found.append(("choice", req.guided_choice, "guided_choice"))
    if req.guided_grammar is not None:
        found.append(("grammar", req.guided_grammar, "guided_grammar"))
    for key, value in (req.structured_outputs or {}).items():
        kind = {"json": "json_schema", "regex": "regex", "choice": "choice",
                "grammar": "grammar", "json_object": "json_object"}.get(key)
        if kind is None or value is None or (kind == "json_object" and not value):
            continue  # unset, or one of vLLM's other keys (whitespace options, ...)
        if kind == "json_schema":
            value = _loads(value, "structured_outputs")
        found.append((kind, None if kind == "json_object" else value, "structured_outputs"))
    if len(found) > 1:
        raise APIError(400, f"{found[1][2]}: only one output format per request "
                       f"({found[0][2]} is set too)", param=found[1][2])
    return found[0] if found else None


def requested_tools(req: ChatCompletionRequest) -> ToolRequest | None:
    """What the request's tools and tool_choice ask of the output (None: no tool calls)."""
    tools, choice = req.tools or [], req.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    params: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(function, dict):
            raise APIError(400, f"tools[{i}] must be a function tool: {{\"type\": \"function\", "
                           "\"function\": {\"name\": ...}}", param=f"tools[{i}]")
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise APIError(400, f"tools[{i}].function.name must match [A-Za-z0-9_-]{{1,64}}",
                           param=f"tools[{i}].function.name")
        if name in params:
            raise APIError(400, f"tools[{i}]: a second function named {name!r}",
                           param=f"tools[{i}].function.name")
        schema = function.get("parameters")
        schema = {"type": "object", "properties": {}} if schema is None else schema
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema of an "
                           "object (the arguments are a JSON object)",
                           param=f"tools[{i}].function.parameters")
        params[name] = schema
    if choice == "none":
        return None
    if choice in (None, "auto"):
        return ToolRequest(None)
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name},
                                                   "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in params.items()]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls},
                                 "maxItems": 1 if req.parallel_tool_calls is False
                                 else MAX_PARALLEL_CALLS}
        return ToolRequest(array)
    if not isinstance(choice, dict) or choice.get("type", "function") != "function" \
            or not isinstance(choice.get("function"), dict):
        raise APIError(400, "tool_choice must be \"none\", \"auto\", \"required\" or name one "
                       "of the tools: {\"type\": \"function\", \"function\": {\"name\": ...}}",
                       param="tool_choice")
    named = choice["function"].get("name")
    if named not in params:
        raise APIError(400, f"tool_choice names {named!r}, which is not one of the tools "
                       f"({', '.join(params)})", param="tool_choice")
    return ToolRequest(params[named], named)


class GuideCompiler:
    """Request formats -> validated grammar texts, off the event loop; the last few hundred
    are remembered, so a client that sends the same schema again pays nothing."""

    CACHE_SIZE = 256

    def __init__(self, model_dir: Path, eos_ids: list[int]) -> None:
        self._model_dir, self._eos_ids = model_dir, eos_ids
        self._cache: OrderedDict[bytes, str] = OrderedDict()

    def _compile(self, kind: str, value: Any) -> str:
        grammar = guide_grammar(kind, value)
        validate(grammar, guide_vocabulary(self._model_dir, self._eos_ids).tokenizer)
        return grammar

    async def compile(self, kind: str, value: Any, param: str) -> str:
        key = orjson.dumps([kind, value], option=orjson.OPT_SORT_KEYS)
        grammar = self._cache.get(key)
        if grammar is None:
            try:
                grammar = await asyncio.to_thread(self._compile, kind, value)
            except GrammarError as exc:
                raise APIError(400, f"{param}: {user_reason(kind, str(exc))}",
                               param=param) from None
            self._cache[key] = grammar
            if len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return grammar


_POSITION = re.compile(r"^(?:at )?(\d+)\((\d+)\):\s*")  # llguidance's "at 3(8): "
_EXCERPT = re.compile(r"^\s*(\d+ \|.*|\^+)\s*$")  # its quote of the grammar: "  3 | ...", "  ^"
_WHAT = {"json_schema": "invalid JSON schema", "grammar": "invalid grammar"}


def user_reason(kind: str, error: str) -> str:
    """A guide's compile error (GrammarError: llguidance's report) in the user's terms: what is
    wrong, without the grammar evenflow generated around it (its text, positions in it, its
    internal names). A user's own grammar keeps the line and column."""
    lines = [line for line in error.strip().splitlines()
             if line.strip() and not _EXCERPT.match(line)]
    if not lines:
        return _WHAT.get(kind, "invalid " + kind.replace("_", " "))
    position = _POSITION.match(lines[0])
    head = lines[0][position.end():] if position else lines[0]
    head = head.removeprefix("failed to compile JSON schema: ")
    # the regex crate's report: "regex parse error:", the regex, a caret, "error: why"
    cause = next((line.strip()[7:] for line in lines[1:]
                  if line.strip().startswith("error: ")), None)
    if cause is not None:
        head = head.replace(" (in regex)", "").replace("regex parse error:", "").strip(" :")
        head = f"{head or 'invalid regex ' + orjson.dumps(lines[1].strip()).decode()}: {cause}"
    if kind == "grammar" and position:
        head = f"line {position[1]}, column {position[2]}: {head}"
    if head[1:2].islower():  # "Invalid type: x" -> "invalid type: x" (not "JSON ...")
        head = head[0].lower() + head[1:]
    if kind in _WHAT:
        head = f"{_WHAT[kind]}: {head}"
    return " ".join(head.split())[:400]
