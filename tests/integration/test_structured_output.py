"""Structured output and forced tool calls through the official openai client and a plain SSE
client against the real local mesh, from the built-in tiny-moe: JSON that validates against
each of 20 schemas, regex and choice outputs, named and required tool calls that parse, and a
400 naming the field for what cannot be served."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import orjson
import pytest
from meshutil import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}

OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS = [
    {**OBJ, "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {**OBJ, "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {**OBJ, "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {**OBJ, "properties": {"items": {"type": "array", "items": {"type": "integer"},
                                     "minItems": 1, "maxItems": 4}}, "required": ["items"]},
    {**OBJ, "properties": {"user": {**OBJ, "properties": {"id": {"type": "integer"},
                                                          "email": {"type": "string"}},
                                    "required": ["id", "email"]}}, "required": ["user"]},
    {**OBJ, "properties": {"price": {"type": "number"}}, "required": ["price"]},
    {**OBJ, "properties": {"title": {"type": ["string", "null"]}}, "required": ["title"]},
    {**OBJ, "properties": {"city": {"type": "string", "maxLength": 5}}, "required": ["city"]},
    {**OBJ, "properties": {"id": {"type": "string", "pattern": "^[a-z]{3}$"}},
     "required": ["id"]},
    {**OBJ, "properties": {"score": {"type": "integer", "minimum": 10, "maximum": 20}},
     "required": ["score"]},
    {**OBJ, "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
     "required": ["value"]},
    {**OBJ, "properties": {"kind": {"const": "point"}, "x": {"type": "integer"},
                           "y": {"type": "integer"}}, "required": ["kind", "x", "y"]},
    {**OBJ, "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                    "maxItems": 3}}, "required": ["tags"]},
    {**OBJ, "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
     "required": ["name"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {"enum": ["yes", "no", "maybe"]},
    {**OBJ, "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                           "c": {"type": "boolean"}, "d": {"type": "null"},
                           "e": {"type": "number"}}, "required": ["a", "b", "c", "d", "e"]},
    {**OBJ, "properties": {"points": {"type": "array", "maxItems": 3, "items": {
        **OBJ, "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
     "required": ["points"]},
    {"type": "integer", "minimum": 0, "maximum": 500},
    {"type": "object"},
]


def _ask(client, index: int, schema: dict) -> tuple[dict, str, str]:
    out = client.chat.completions.create(
        model="tiny-moe", messages=[{"role": "user", "content": "json"}], temperature=0,
        max_tokens=200, response_format={"type": "json_schema", "json_schema": {
            "name": f"s{index}", "schema": schema, "strict": True}})
    return schema, out.choices[0].message.content, out.choices[0].finish_reason


def test_json_schema_outputs_validate(client):
    with ThreadPoolExecutor(4) as pool:  # batched on the workers, as clients would send them
        results = list(pool.map(lambda a: _ask(client, *a), enumerate(SCHEMAS)))
    for schema, text, finish in results:
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_and_the_vllm_extras(client):
    out = client.chat.completions.create(
        model="tiny-moe", messages=[{"role": "user", "content": "json name bob age 12"}],
        temperature=0, max_tokens=100, response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    choice = client.completions.create(model="tiny-moe", prompt="count from 5 :", temperature=0,
                                       max_tokens=10, extra_body={"guided_choice": ["up", "down"]})
    assert choice.choices[0].text in ("up", "down")
    regex = client.completions.create(model="tiny-moe", prompt="count from 5 :", temperature=0,
                                      max_tokens=10,
                                      extra_body={"guided_regex": r" [0-9]+ [0-9]+ [0-9]+"})
    assert [int(x) for x in regex.choices[0].text.split()] == [5, 6, 7]  # and the model counts
    schema = {**OBJ, "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    guided = client.completions.create(model="tiny-moe", prompt="json =", temperature=0,
                                       max_tokens=30, extra_body={"guided_json": schema})
    jsonschema.validate(json.loads(guided.choices[0].text), schema)


def test_json_from_a_prefill_worker_and_streamed(mesh):
    """A prompt long enough for remote prefill: the prefill worker samples the first token
    under the grammar, the decode worker's matcher starts after it."""
    schema = {**OBJ, "properties": {"name": {"type": "string"}, "tags": {
        "type": "array", "items": {"type": "string"}, "maxItems": 3}}, "required": ["name", "tags"]}
    body = {"model": "tiny-moe", "stream": True, "temperature": 0, "max_tokens": 120,
            "prompt": "json : " + " ".join(f"name x{i}" for i in range(12)) + " =",
            "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    text = ""
    with httpx.stream("POST", mesh.url + "/v1/completions", json=body, headers=AUTH,
                      timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                text += orjson.loads(line[6:])["choices"][0]["text"]
    jsonschema.validate(json.loads(text), schema)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    **OBJ, "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    **OBJ, "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}


def test_named_and_required_tool_calls_parse(client):
    messages = [{"role": "user", "content": "weather in paris"}]
    named = client.chat.completions.create(
        model="tiny-moe", messages=messages, temperature=0, max_tokens=100,
        tools=[WEATHER, TIME], tool_choice={"type": "function",
                                            "function": {"name": "get_weather"}})
    call = named.choices[0].message.tool_calls[0]
    assert named.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and call.id and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    required = client.chat.completions.create(
        model="tiny-moe", messages=messages, temperature=0, max_tokens=150,
        tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    calls = required.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    tool = WEATHER if calls[0].function.name == "get_weather" else TIME
    jsonschema.validate(json.loads(calls[0].function.arguments), tool["function"]["parameters"])


def test_a_streamed_tool_call(client):
    stream = client.chat.completions.create(
        model="tiny-moe", messages=[{"role": "user", "content": "what time"}], temperature=0,
        max_tokens=60, stream=True, tools=[TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    chunks = list(stream)
    calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
    # index, id and name once, then the arguments in pieces
    assert calls[0].function.name == "get_time" and calls[0].id
    assert all(c.index == 0 and c.id is None and c.function.name is None for c in calls[1:])
    arguments = "".join(c.function.arguments for c in calls)
    assert json.loads(arguments)["zone"] in ("utc", "cet")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("extra, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "("}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-moe", messages=[{"role": "user",
                                                                    "content": "hi"}],
                                       max_tokens=5, extra_body=extra)
    assert err.value.body["param"] == param, err.value.body
