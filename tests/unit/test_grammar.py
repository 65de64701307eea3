"""Structured output's shared half (proto/grammar.py): every output format compiles into a
grammar the model's vocabulary can be matched against, a bad one is refused with a message
naming the problem, and the word-level vocabulary's tokenizer gives llguidance tokens whose
bytes add up to exactly the text it was given."""

from __future__ import annotations

import llguidance
import pytest

from evenflow import models
from evenflow.proto.grammar import (
    GrammarError,
    _VocabularyBytes,
    guide_grammar,
    guide_vocabulary,
    validate,
)
from evenflow.proto.tokenizer import Tokenizer

TINY = models.resolve_model("tiny-moe")


@pytest.fixture(scope="module")
def vocabulary():
    return guide_vocabulary(TINY, [Tokenizer(TINY).eos_token_id])


@pytest.mark.parametrize("kind, value", [
    ("json_object", None),
    ("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}}),
    ("regex", r"[a-z]+ [0-9]{1,3}"),
    ("choice", ["yes", "no"]),
    ("grammar", 'start: "a" | "b" "c"'),
    ("grammar", 'root ::= "a" | "b"'),  # GBNF, as vLLM's guided_grammar also takes
])
def test_every_format_compiles(vocabulary, kind, value):
    validate(guide_grammar(kind, value), vocabulary.tokenizer)


@pytest.mark.parametrize("kind, value, words", [
    ("json_schema", [1], "must be an object"),
    ("json_schema", {"type": "object", "properties": {"a": {"type": "nope"}}}, "nope"),
    ("regex", "(", "regex parse error"),
    ("choice", [], "non-empty"),
    ("grammar", "start: undefined_rule", "undefined_rule"),
    ("fancy", None, "unknown guide kind"),
])
def test_a_bad_format_is_refused_with_the_reason(vocabulary, kind, value, words):
    with pytest.raises(GrammarError, match=words):
        validate(guide_grammar(kind, value), vocabulary.tokenizer)


def test_word_level_tokens_add_up_to_the_text(vocabulary):
    tok = Tokenizer(TINY)
    spec = __import__("json").loads((TINY / "tokenizer.json").read_text())
    words = _VocabularyBytes(spec, tok.eos_token_id, None)
    for text in [' {"name": "bob", "age": 12}', "count ", " 17 18", "x", ' "a b"', " "]:
        ids = words(text.encode())
        assert b"".join(words.tokens[i] for i in ids) == text.encode(), text
    # what the engine decodes a token to is what llguidance was told its bytes are
    ids = tok.encode(' {"name": "bob"}', add_special_tokens=False)
    assert tok.decode([tok.encode("x", add_special_tokens=False)[0], *ids])[1:] == \
        b"".join(words.tokens[i] for i in ids).decode()
    assert vocabulary.never_sampled == (words.space,)


def test_a_matcher_walks_a_json_object(vocabulary):
    tok = Tokenizer(TINY)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    matcher = llguidance.LLMatcher(vocabulary.tokenizer, guide_grammar("json_schema", schema))
    for token in tok.encode(' {"n": 42}', add_special_tokens=False):
        assert matcher.consume_token(token), matcher.get_error()
    assert matcher.is_accepting() and matcher.is_stopped()
