"""Tool calling as agent frameworks send it, through the official openai client against the
real local mesh (tiny-moe, whose chat template renders tools Hermes-style): "required" (with
parallel calls and without), named, "auto" and "none", streamed and not; a tool round trip; the
model's own `<tool_call>` syntax parsed into calls (forced out of the random checkpoint by a
guided regex); and the 400s for bad tools, naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

OBJ = {"type": "object", "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    **OBJ, "properties": {"city": {"type": "string", "maxLength": 12},
                          "days": {"type": "integer"}}, "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    **OBJ, "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "weather in paris and the time"}]


def _valid(calls: list[tuple[str, str]]) -> None:
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _streamed(stream) -> tuple[str, list[tuple[str, str]], str | None]:
    """Content, calls (name, arguments) and the finish reason, added up from the deltas:
    index, id and name come once per call, arguments in pieces."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.index not in calls and call.function.name
                calls[call.index] = [call.function.name, ""]
            calls[call.index][1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("parallel", [None, False])
def test_required_calls_come_back_as_calls_streamed_and_not(client, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    for max_tokens in (40, 400):  # cut short, and with room
        out = client.chat.completions.create(
            model="tiny-moe", messages=ASK, temperature=0, max_tokens=max_tokens,
            tools=[WEATHER, TIME], tool_choice="required", **extra)
        choice = out.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        _valid(calls)
        assert not choice.message.content  # never the array's text
        assert choice.finish_reason in ("tool_calls", "length")
        if choice.finish_reason == "tool_calls":
            assert calls and (parallel is None or len(calls) == 1)
        content, streamed, finish = _streamed(client.chat.completions.create(
            model="tiny-moe", messages=ASK, temperature=0, max_tokens=max_tokens,
            tools=[WEATHER, TIME], tool_choice="required", stream=True, **extra))
        assert (content, streamed, finish) == ("", calls, choice.finish_reason)
    if parallel is False:  # one call closes the array (up to 8 calls need more than the
        assert finish == "tool_calls"  # character-level tiny-moe's 512-token context)


def test_a_named_call_streamed_and_not(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model="tiny-moe", messages=ASK, temperature=0,
                                         max_tokens=100, tools=[WEATHER, TIME],
                                         tool_choice=choice)
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and out.choices[0].finish_reason == "tool_calls"
    _valid([(call.function.name, call.function.arguments)])
    content, calls, finish = _streamed(client.chat.completions.create(
        model="tiny-moe", messages=ASK, temperature=0, max_tokens=100, tools=[WEATHER, TIME],
        tool_choice=choice, stream=True))
    assert calls == [("get_weather", call.function.arguments)] and finish == "tool_calls"


@pytest.mark.parametrize("tool_choice", ["auto", "none", None])
def test_auto_and_none_are_answered(client, tool_choice):
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    out = client.chat.completions.create(model="tiny-moe", messages=ASK, temperature=0,
                                         max_tokens=12, tools=[WEATHER, TIME], **extra)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert out.choices[0].message.content is not None or out.choices[0].message.tool_calls


def test_a_tool_round_trip_is_answered(client):
    first = client.chat.completions.create(
        model="tiny-moe", messages=ASK, temperature=0, max_tokens=100, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18}'}]
    second = client.chat.completions.create(model="tiny-moe", messages=messages, temperature=0,
                                            max_tokens=8, tools=[WEATHER])
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the call and its answer are in the prompt the template rendered
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10


HERMES = (r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,8}", '
          r'"days": [1-7]\}\}</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_models_own_tool_syntax(client, stream):
    """The random checkpoint is made to write Hermes' syntax (a guided regex); "auto" reads it
    back as a call, and no piece of the syntax reaches content."""
    kwargs = {"model": "tiny-moe", "messages": ASK, "temperature": 0, "max_tokens": 150,
              "tools": [WEATHER], "extra_body": {"guided_regex": r"Sure\. " + HERMES}}
    if stream:
        content, calls, finish = _streamed(client.chat.completions.create(**kwargs,
                                                                          stream=True))
    else:
        out = client.chat.completions.create(**kwargs)
        content, finish = out.choices[0].message.content, out.choices[0].finish_reason
        calls = [(c.function.name, c.function.arguments) for c in out.choices[0].message.tool_calls]
    assert content == "Sure. " and finish == "tool_calls"
    assert [name for name, _ in calls] == ["get_weather"]
    _valid(calls)


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": [*ASK, {"role": "tool", "content": "18"}]}, "messages[1].tool_call_id"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "18"}]},
     "messages[1].tool_call_id"),
])
def test_bad_tools_are_a_400_naming_the_field(client, extra, param):
    body = {"messages": ASK, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-moe", max_tokens=5, **body)
    assert err.value.body["param"] == param, err.value.body


@pytest.fixture(scope="module")
def reasoning_client():
    """A mesh of its own whose gateway splits reasoning (deepseek_r1)."""
    from openai import OpenAI

    from evenflow.services.config import MeshConfig
    from tests.integration.meshutil import running_mesh

    config = MeshConfig(port=0, num_prefill=0, num_decode=1, num_ep_ranks=0, num_gateways=1,
                        reasoning_parser="deepseek_r1", log_level="warning",
                        stats_log_interval_s=0)
    with running_mesh(config) as mesh:
        yield OpenAI(base_url=mesh.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_comes_back_as_reasoning_content(reasoning_client, stream):
    kwargs = {"model": "tiny-moe", "temperature": 0, "max_tokens": 80,
              "messages": [{"role": "user", "content": "think, then answer"}],
              "extra_body": {"guided_regex": r"[a-z]{3,12}( [a-z]{2,8}){2}</think> [a-z]{2,9}",
                             "chat_template_kwargs": {"enable_thinking": True}}}
    if stream:
        reasoning = content = ""
        for chunk in reasoning_client.chat.completions.create(**kwargs, stream=True):
            delta = chunk.choices[0].delta if chunk.choices else None
            reasoning += (getattr(delta, "reasoning_content", None) or "") if delta else ""
            content += (delta.content or "") if delta else ""
    else:
        message = reasoning_client.chat.completions.create(**kwargs).choices[0].message
        reasoning, content = message.reasoning_content, message.content
    # (tiny-moe's word-piece vocabulary has no newline: the tags sit between words)
    assert reasoning.count(" ") == 2 and "<" not in reasoning
    assert content.strip().isalpha()
