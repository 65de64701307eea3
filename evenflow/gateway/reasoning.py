"""Reasoning split out of the answer (`--reasoning-parser`), into `reasoning_content`:

  deepseek_r1  everything up to </think> is reasoning (the template opens <think> in the
               prompt; one the model writes itself is dropped); no </think> yet: all reasoning
  qwen3        an output that opens with <think> reasons until </think>; one that does not
               (enable_thinking false: the template closed an empty block) is all answer
  gpt_oss      harmony's analysis channel (gateway/tool_parsers.py HarmonyParser)

Like the tool parsers, a pure function of the text so far (`split(text, final)` -> reasoning,
answer), whose parse of a prefix is a prefix of the parse of the whole: a partial tag at the
end is held back until it is decided."""

from __future__ import annotations

from evenflow.gateway.tool_parsers import HarmonyParser, held_back

START, END = "<think>", "</think>"


class ReasoningParser:
    name = ""
    needs_special_tokens = False

    def split(self, text: str, final: bool) -> tuple[str, str]:
        raise NotImplementedError


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"

    def split(self, text: str, final: bool) -> tuple[str, str]:
        lead = len(text) - len(text.lstrip())
        if text.startswith(START, lead):
            text = text[lead + len(START):]
        elif not final and START.startswith(text[lead:]) and text[lead:]:
            return "", ""  # maybe the tag
        at = text.find(END)
        if at >= 0:
            return text[:at], text[at + len(END):].lstrip("\n")
        return (text if final else text[:len(text) - held_back(text, (END,))]), ""


class Qwen3Parser(ReasoningParser):
    name = "qwen3"

    def split(self, text: str, final: bool) -> tuple[str, str]:
        body = text.lstrip()
        if not body.startswith(START):
            if not final and (not body or START.startswith(body)):
                return "", ""  # undecided
            return "", text
        return DeepSeekR1Parser().split(body, final)


class GptOssParser(ReasoningParser):
    name = "gpt_oss"
    needs_special_tokens = True

    def split(self, text: str, final: bool) -> tuple[str, str]:
        parsed = HarmonyParser().parse(text, final)
        return parsed.reasoning, parsed.content


PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (
    DeepSeekR1Parser, Qwen3Parser, GptOssParser)}


def make_parser(name: str) -> ReasoningParser:
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r} (known: {', '.join(PARSERS)})")
    return PARSERS[name]()
