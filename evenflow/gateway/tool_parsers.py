"""Tool calls in a model's own syntax (`tool_choice: "auto"`), one parser per family, chosen by
`--tool-call-parser` or detected from the chat template (`detect`):

  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>  (Qwen2.5, Qwen3, ...)
  llama3_json  {"name": ..., "parameters": {...}}; ...  the whole output, or after <|python_tag|>
  mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], or [TOOL_CALLS]name[ARGS]{...}
  deepseek_v3  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name
               ```json {...} ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
               (V3.1: name<｜tool▁sep｜>{...})
  openai       GPT-OSS's harmony messages: <|channel|>commentary to=functions.name ...
               <|message|>{...}<|call|>; the analysis channel is reasoning, the final
               channel content

A parser is a pure function of the text so far: `parse(text, final)` -> content, reasoning (the
harmony parser only) and the calls seen, each call's arguments as the raw JSON text so far. The
streaming side (gateway/agent_output.py) sends what each new parse adds, so a parse of a prefix
must be a prefix of the parse of the whole: text that may still become tool syntax (a partial
marker at the end) is held back from content until it is decided, never leaked."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import orjson


@dataclass
class Call:
    name: str | None  # None: not complete yet
    arguments: str  # the raw JSON text of the arguments so far
    complete: bool = False


@dataclass
class Parsed:
    content: str = ""
    calls: list[Call] = field(default_factory=list)
    reasoning: str = ""


# -- scanning JSON that may be cut short ------------------------------------------------------
_WS = " \t\r\n"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def value_end(text: str, start: int) -> int | None:
    """Where the JSON value at `start` ends (exclusive), or None when the text ends first."""
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        return _string_end(text, start)
    if first not in "[{":  # a number or literal: ends at a delimiter
        i = start
        while i < len(text) and text[i] not in ",]}" + _WS:
            i += 1
        return i if i < len(text) else None
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c == '"':
            end = _string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _string_end(text: str, start: int) -> int | None:
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return None


@dataclass
class ScannedObject:
    fields: dict[str, tuple[int, int | None]]  # key -> (value start, value end or None)
    end: int | None  # past the closing brace; None: not closed yet


def scan_object(text: str, start: int) -> ScannedObject | None:
    """The keys of the JSON object at `start` and where their values lie, as far as the text
    goes (None: no object starts there)."""
    if start >= len(text) or text[start] != "{":
        return None
    found: dict[str, tuple[int, int | None]] = {}
    i = skip_ws(text, start + 1)
    while i < len(text):
        if text[i] == "}":
            return ScannedObject(found, i + 1)
        if text[i] == ",":
            i = skip_ws(text, i + 1)
            continue
        if text[i] != '"':
            return ScannedObject(found, None)
        key_end = _string_end(text, i)
        if key_end is None:
            break
        key = orjson.loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text) or text[i] != ":":
            break
        i = skip_ws(text, i + 1)
        if i >= len(text):
            break
        end = value_end(text, i)
        found[key] = (i, end)
        if end is None:
            break
        i = skip_ws(text, end)
    return ScannedObject(found, None)


def call_from_object(text: str, start: int, args_keys: tuple[str, ...] = ("arguments",
                                                                          "parameters")
                     ) -> tuple[Call | None, int | None]:
    """A {"name": ..., "arguments": {...}} object at `start`: the call as far as it goes, and
    where the object ends (None: not yet)."""
    scanned = scan_object(text, start)
    if scanned is None:
        return None, None
    name = None
    if "name" in scanned.fields:
        name_start, name_end = scanned.fields["name"]
        if name_end is not None:
            value = orjson.loads(text[name_start:name_end])
            name = value if isinstance(value, str) else None
    arguments = ""
    for key in args_keys:
        if key in scanned.fields:
            a, b = scanned.fields[key]
            arguments = text[a:len(text) if b is None else b]
            break
    complete = scanned.end is not None and name is not None
    if complete and arguments.startswith('"'):  # arguments sent as a JSON string
        value = orjson.loads(arguments)
        arguments = value if isinstance(value, str) else arguments
    return Call(name, arguments or ("{}" if complete else ""), complete), scanned.end


def call_at(name: str, text: str, start: int) -> tuple[Call, int | None]:
    """A call whose arguments are the JSON value at `start`, as far as the text goes, and
    where that value ends (None: not yet)."""
    end = value_end(text, start)
    return Call(name, text[start:len(text) if end is None else end], end is not None), end


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of a marker."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-n:]):
                longest = n
                break
    return longest


def _content(text: str, final: bool, markers: tuple[str, ...]) -> str:
    return text if final else text[:len(text) - held_back(text, markers)]


def _all_valid(calls: list[Call]) -> bool:
    for call in calls:
        if not call.complete:
            return False
        try:
            orjson.loads(call.arguments)
        except orjson.JSONDecodeError:
            return False
    return True


class ToolParser:
    name = ""
    needs_special_tokens = False  # its markers are special tokens: decode them as text

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def _finished(self, parsed: Parsed, text: str, final: bool) -> Parsed:
        """A final parse whose calls do not all parse is the model's text, as content."""
        if final and parsed.calls and not _all_valid(parsed.calls):
            return Parsed(text, [], parsed.reasoning)
        return parsed


class HermesParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Parsed:
        at = text.find(self.START)
        if at < 0:
            return Parsed(_content(text, final, (self.START,)))
        parsed = Parsed(text[:at])
        while at >= 0:
            body = skip_ws(text, at + len(self.START))
            call, end = call_from_object(text, body)
            if call is None:  # not JSON (yet)
                if body < len(text) or final:
                    parsed.calls.append(Call(None, "", False))
                break
            parsed.calls.append(call)
            if end is None:
                break
            at = text.find(self.START, end)  # (what follows the last call is dropped)
        return self._finished(parsed, text, final)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_ws(text, 0)
        rest = text[start:]
        if rest.startswith(self.TAG):
            start = skip_ws(text, start + len(self.TAG))
        elif not final and (not rest or self.TAG.startswith(rest)):
            return Parsed()  # undecided: the tag may be coming
        if start >= len(text):
            return Parsed(text if final and not rest.startswith(self.TAG) else "")
        if text[start] != "{":
            return Parsed(_content(text, final, ()))  # plain text
        parsed = Parsed()
        i = start
        while i < len(text):
            call, end = call_from_object(text, i, ("parameters", "arguments"))
            if call is None:
                break
            parsed.calls.append(call)
            if end is None:
                break
            i = skip_ws(text, end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
        return self._finished(parsed, text, final)


class MistralParser(ToolParser):
    name = "mistral"
    START, ARGS = "[TOOL_CALLS]", "[ARGS]"
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> Parsed:
        at = text.find(self.START)
        if at < 0:
            return Parsed(_content(text, final, (self.START,)))
        parsed = Parsed(text[:at])
        while at >= 0:
            i = skip_ws(text, at + len(self.START))
            if i < len(text) and text[i] == "[":  # v0.3: a JSON array of calls
                i = skip_ws(text, i + 1)
                while i < len(text) and text[i] == "{":
                    call, end = call_from_object(text, i)
                    assert call is not None
                    parsed.calls.append(call)
                    if end is None:
                        break
                    i = skip_ws(text, end)
                    if i < len(text) and text[i] == ",":
                        i = skip_ws(text, i + 1)
                break
            args = text.find(self.ARGS, i)  # v11+: name[ARGS]{...}
            if args < 0:
                break
            call, end = call_at(text[i:args].strip(), text, skip_ws(text, args + len(self.ARGS)))
            parsed.calls.append(call)
            if end is None:
                break
            at = text.find(self.START, end)
        return self._finished(parsed, text, final)


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"
    CALLS = "<｜tool▁calls▁begin｜>"
    BEGIN, SEP, END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
    needs_special_tokens = True
    _FENCE = re.compile(r"\s*```(?:json)?\s*")

    def parse(self, text: str, final: bool) -> Parsed:
        at = text.find(self.CALLS)
        if at < 0:
            return Parsed(_content(text, final, (self.CALLS,)))
        parsed = Parsed(text[:at])
        begin = text.find(self.BEGIN, at)
        while begin >= 0:
            sep = text.find(self.SEP, begin)
            if sep < 0:
                break
            kind = text[begin + len(self.BEGIN):sep].strip()
            i = sep + len(self.SEP)
            if kind == "function":  # V3: name on its own line, the arguments fenced
                newline = text.find("\n", i)
                if newline < 0:
                    break
                name = text[i:newline].strip()
                fence = self._FENCE.match(text, newline)
                i = fence.end() if fence else newline + 1
            else:  # V3.1: the name before the separator, the arguments right after
                name = kind
            i = skip_ws(text, i)
            if i < len(text) and text[i] != "{" and not final:
                break  # (the fence still coming)
            call, end = call_at(name, text, i)
            parsed.calls.append(call)
            if end is None:
                break
            begin = text.find(self.BEGIN, end)
        return self._finished(parsed, text, final)


class HarmonyParser(ToolParser):
    """GPT-OSS's harmony format: each message a header (`<|channel|>name`, a recipient
    ` to=functions.x`, a content type) then `<|message|>` and its text up to `<|end|>`,
    `<|call|>` or `<|return|>`; messages after the first start with `<|start|>assistant`."""

    name = "openai"
    needs_special_tokens = True
    MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>",
               "<|constrain|>")
    _RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
    _MESSAGE_END = re.compile(r"<\|end\|>|<\|call\|>|<\|return\|>")

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = Parsed()
        i = 0
        while i < len(text):
            head_end = text.find("<|message|>", i)
            if head_end < 0:
                head = text[i:]
                if i == 0 and "<|" not in head:  # not harmony at all: the model's plain text
                    parsed.content += _content(head, final, self.MARKERS)
                break
            header = text[i:head_end]
            body_start = head_end + len("<|message|>")
            ended = self._MESSAGE_END.search(text, body_start)
            body_end = ended.start() if ended else len(text)
            body = text[body_start:body_end]
            if not ended and not final:
                body = body[:len(body) - held_back(body, self.MARKERS)]
            channel = re.search(r"<\|channel\|>\s*(\w+)", header)
            recipient = self._RECIPIENT.search(header)
            if recipient:
                parsed.calls.append(Call(recipient[1], body, ended is not None or final))
            elif channel and channel[1] == "analysis":
                parsed.reasoning += body
            else:  # final, or commentary meant for the user (a preamble)
                parsed.content += body
            if not ended:
                break
            i = ended.end()
            if text.startswith("<|start|>", i):
                i += len("<|start|>")
        return self._finished(parsed, text, final)


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesParser, Llama3JsonParser, MistralParser, DeepSeekV3Parser, HarmonyParser)}


def detect(chat_template: str | None) -> str | None:
    """The tool-call parser a chat template's own syntax calls for (None: none known)."""
    template = chat_template or ""
    for marker, parser in (("<|channel|>", "openai"), ("tool▁calls▁begin", "deepseek_v3"),
                           ("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"),
                           ("<|python_tag|>", "llama3_json"),
                           ("Environment: ipython", "llama3_json")):
        if marker in template:
            return parser
    return None


def make_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r} (known: {', '.join(PARSERS)})")
    return PARSERS[name]()
