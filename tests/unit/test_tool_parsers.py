"""Tool-call and reasoning parsers on each family's real syntax: whole, the content, reasoning and
calls a user gets; streamed, the same text cut at every character boundary gives deltas that
add up to the whole answer, and no piece of tool syntax ever reaches `content`."""

from __future__ import annotations

import json

import pytest

from evenflow.gateway.agent_output import CallArray, NamedCall, OutputShape
from evenflow.gateway.reasoning import make_parser as make_reasoning
from evenflow.gateway.tool_parsers import detect, make_parser

WEATHER = {"city": "Paris", "unit": "celsius"}
TIME = {"zone": "UTC+1", "nested": {"a": [1, 2, {"b": "}{\\\""}]}}

# (parser, model output, content, [(name, arguments)])
CASES = [
    ("hermes", 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
     '"arguments": {"zone": "UTC+1", "nested": {"a": [1, 2, {"b": "}{\\\\\\""}]}}}\n'
     '</tool_call>', "Let me check.", [("get_weather", WEATHER), ("get_time", TIME)]),
    ("hermes", "No tools needed: 2 < 3 and <tool is not a call.", "No tools needed: 2 < 3 and "
     "<tool is not a call.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
     '"celsius"}}; {"name": "get_time", "parameters": {"zone": "UTC+1", "nested": {"a": [1, 2, '
     '{"b": "}{\\\\\\""}]}}}', "", [("get_weather", WEATHER), ("get_time", TIME)]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
     '"unit": "celsius"}}', "", [("get_weather", WEATHER)]),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "celsius"}}, {"name": "get_time", "arguments": {"zone": "UTC+1", "nested": '
     '{"a": [1, 2, {"b": "}{\\\\\\""}]}}}]', "Sure. ", [("get_weather", WEATHER),
                                                    ("get_time", TIME)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
     '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC+1", "nested": {"a": [1, 2, {"b": "}{\\\\\\""}]}}',
     "", [("get_weather", WEATHER), ("get_time", TIME)]),
    ("deepseek_v3", "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
     'get_weather\n```json\n{"city": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜>\n'
     "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
     '{"zone": "UTC+1", "nested": {"a": [1, 2, {"b": "}{\\\\\\""}]}}\n```<｜tool▁call▁end｜>'
     "<｜tool▁calls▁end｜>", "Checking.", [("get_weather", WEATHER), ("get_time", TIME)]),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
     '{"city": "Paris", "unit": "celsius"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "",
     [("get_weather", WEATHER)]),
    ("openai", "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>"
     "assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     '{"city": "Paris", "unit": "celsius"}<|call|>', "", [("get_weather", WEATHER)]),
    ("openai", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
     "<|message|>It is 4.<|return|>", "It is 4.", []),
]


def streamed(shape: OutputShape, text: str, cuts: list[int]) -> dict:
    """The deltas of `text` fed in the pieces `cuts` makes, added up into one message."""
    split = shape.split()
    content, reasoning, calls = "", "", {}
    bounds = [0, *cuts, len(text)]
    for k, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        delta = split.feed(text[a:b], final=k == len(bounds) - 2) or {}
        content += delta.get("content", "")
        reasoning += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] not in calls  # index, id and name once
                calls[call["index"]] = [call["function"]["name"], ""]
            calls[call["index"]][1] += call["function"]["arguments"]
    return {"content": content, "reasoning": reasoning,
            "calls": [tuple(calls[i]) for i in sorted(calls)]}


def _calls(expected):
    return [(name, args) for name, args in expected]


@pytest.mark.parametrize("parser,text,content,expected", CASES)
def test_each_family_whole_and_split_at_every_boundary(parser, text, content, expected):
    shape = OutputShape(tools=lambda: make_parser(parser))
    split = shape.split()
    split.feed(text, final=True)
    message = split.message()
    assert (message["content"] or "") == content
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
           for c in message.get("tool_calls", [])]
    assert got == _calls(expected)
    assert split.finish_reason("stop") == ("tool_calls" if expected else "stop")
    for cut in range(1, len(text)):
        out = streamed(shape, text, [cut])
        assert out["content"] == content, cut
        assert [(n, json.loads(a)) for n, a in out["calls"]] == got, cut
    every = streamed(shape, text, list(range(1, len(text))))  # a character at a time
    assert every["content"] == content
    assert [(n, json.loads(a)) for n, a in every["calls"]] == got


@pytest.mark.parametrize("parser,text,reasoning,content", [
    ("deepseek_r1", "The user says hi.\n</think>\n\nHello!", "The user says hi.\n", "Hello!"),
    ("deepseek_r1", "<think>Hmm.</think>Hi", "Hmm.", "Hi"),
    ("deepseek_r1", "Still thinking when cut", "Still thinking when cut", ""),
    ("qwen3", "<think>\nCount: 1, 2.\n</think>\n\nThree.", "\nCount: 1, 2.\n", "Three."),
    ("qwen3", "Three, without thinking.", "", "Three, without thinking."),
    ("gpt_oss", "<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>"
     "final<|message|>5<|return|>", "Add them.", "5"),
])
def test_reasoning_whole_and_split_at_every_boundary(parser, text, reasoning, content):
    shape = OutputShape(reasoning=lambda: make_reasoning(parser))
    split = shape.split()
    split.feed(text, final=True)
    message = split.message()
    assert (message["reasoning_content"] or "") == reasoning
    assert message["content"] == content
    for cut in range(1, len(text)):
        out = streamed(shape, text, [cut])
        assert (out["reasoning"], out["content"]) == (reasoning, content), cut


def test_reasoning_then_a_hermes_call():
    shape = OutputShape(tools=lambda: make_parser("hermes"),
                        reasoning=lambda: make_reasoning("qwen3"))
    text = ('<think>I need the weather.</think>\n\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>')
    out = streamed(shape, text, list(range(1, len(text))))
    assert out["reasoning"] == "I need the weather."
    assert out["content"] == "" and out["calls"][0][0] == "get_weather"


def test_a_required_array_cut_short_returns_the_complete_calls_only():
    text = ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", '
            '"parameters": {"zone": "UT')
    split = OutputShape(tools=CallArray).split()
    split.feed(text, final=True)
    message = split.message()
    assert message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert split.finish_reason("length") == "length"
    # streamed: the complete call goes out whole, the cut one never
    out = streamed(OutputShape(tools=CallArray), text, list(range(1, len(text))))
    assert out["calls"] == [("get_weather", '{"city": "Paris"}')] and out["content"] == ""


def test_a_named_call_streams_its_arguments_in_pieces():
    split = OutputShape(tools=lambda: NamedCall("get_time")).split()
    first = split.feed('{"zone"')
    assert first["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"zone"'}
    more = split.feed(': "UTC"}', final=True)
    assert more["tool_calls"] == [{"index": 0, "function": {"arguments": ': "UTC"}'}}]
    assert split.finish_reason("stop") == "tool_calls"


@pytest.mark.parametrize("template,parser", [
    ("{% if tools %}<tools></tools>{% endif %}<tool_call>", "hermes"),
    ("<|start|>{{ m }}<|channel|>final", "openai"),
    ("<｜tool▁calls▁begin｜>", "deepseek_v3"),
    ("[AVAILABLE_TOOLS] [TOOL_CALLS]", "mistral"),
    ("Environment: ipython\n<|python_tag|>", "llama3_json"),
    ("{{ messages }}", None),
])
def test_the_parser_is_detected_from_the_chat_template(template, parser):
    assert detect(template) == parser
