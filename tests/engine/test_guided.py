"""Guided decoding in the engine (engine/sample/guided.py) on the built-in tiny-moe: outputs follow
their grammar in a mixed batch, a guided sequence stops as soon as its grammar is complete, a
request continued elsewhere (a prefill worker's first token, a retry's earlier output) resumes
its grammar where it was, and a grammar that cannot build ends only its own request."""

from __future__ import annotations

import json

import jsonschema
import pytest

from evenflow import LLM, SamplingParams
from evenflow.engine.serving.engine import Engine, EngineConfig
from evenflow.proto.grammar import guide_grammar

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-moe")


def guided(kind, value, **kw) -> SamplingParams:
    return SamplingParams(temperature=kw.pop("temperature", 0), max_tokens=kw.pop("max_tokens", 60),
                          guide=guide_grammar(kind, value), **kw)


def test_a_mixed_batch_follows_each_grammar(llm):
    plain = SamplingParams(temperature=0, max_tokens=6)
    outs = llm.generate(
        ["json : name bob age 12 =", "count from 17 :", "count from 5 :", "json ="],
        [guided("json_schema", SCHEMA), plain,
         guided("regex", r" [0-9]+( [0-9]+){2}"),
         guided("json_schema", SCHEMA, temperature=1.0, seed=3)])
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    assert outs[1].text == " 17 18 19 20 21 22"  # an unguided neighbour is untouched
    assert outs[2].text == " 5 6 7" and outs[2].finish_reason == "stop"
    jsonschema.validate(json.loads(outs[3].text), SCHEMA)


def test_sampled_guided_output_is_reproducible_with_a_seed(llm):
    params = guided("json_object", None, temperature=1.0, seed=11, max_tokens=80)
    a, b = (llm.generate(["json ="], params)[0].text for _ in range(2))
    assert a == b and isinstance(json.loads(a), dict)


def test_a_guided_request_resumes_after_output_made_elsewhere():
    """The engine is given the prompt plus the first tokens of an output made by another
    engine (a gateway retry): its grammar consumes them before sampling. (float32: the resumed
    tokens are prefilled where the first engine decoded them, and bf16 can part on a near-tie)"""
    llm = LLM("tiny-moe", dtype="float32")
    engine: Engine = llm.engine
    whole = llm.generate(["json : name bob age 12 ="], guided("json_schema", SCHEMA))[0]
    head = list(whole.token_ids[:5])
    prompt = llm.tokenizer.encode("json : name bob age 12 =")
    engine.add_request("resumed", prompt + head, SamplingParams(
        temperature=0, max_tokens=60, guide=guide_grammar("json_schema", SCHEMA),
        resumed_output_tokens=len(head)))
    tail: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tail += out.new_token_ids
    assert head + tail == list(whole.token_ids)


def test_a_grammar_that_cannot_build_ends_only_its_request():
    engine = Engine(EngineConfig(model="tiny-moe"))
    engine.add_request("bad", [0, 6, 7, 60, 11], SamplingParams(
        temperature=0, max_tokens=8, guide="start: undefined_rule"))
    engine.add_request("good", [0, 6, 7, 60, 11], SamplingParams(temperature=0, max_tokens=4))
    got: dict[str, list[int]] = {"bad": [], "good": []}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert len(got["good"]) == 4
    assert got["bad"] in ([], [1])  # ended at once (EOS), never a token off-grammar
    engine.close()
