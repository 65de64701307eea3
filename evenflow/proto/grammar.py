"""Structured output's shared half: a request's output format as one llguidance grammar, and a
checkpoint's vocabulary as the byte strings llguidance matches grammars against.

Torch-free on purpose: the gateway turns `response_format` / `guided_*` / `tools` into a grammar
and validates it against the model's vocabulary (a bad schema is a 400 before any work), and the
engine builds one matcher per sequence from the same grammar text (engine/sample/guided.py).

Formats (`guide_grammar(kind, value)`):
- "json_schema": a JSON schema (dict); "json_object": any JSON object;
- "regex": a regular expression (Rust `regex` syntax, anchored at both ends);
- "choice": a list of strings, exactly one of which is the output;
- "grammar": a Lark grammar (llguidance's dialect; `%json {...}` embeds a schema) or a GBNF
  one (llama.cpp's), as vLLM's `guided_grammar` takes either.
JSON output may begin with whitespace: with a word-level tokenizer (the built-in tiny-moe) every
word token carries the space that separates it from the text before it.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llguidance

GUIDE_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_GUIDE_CHARS = 1 << 17  # a grammar's text, as it travels in SamplingParams


class GrammarError(ValueError):
    """A guide that does not compile: a malformed schema, regex or grammar."""


def guide_grammar(kind: str, value: Any) -> str:
    """The llguidance grammar text for one output format; raises GrammarError."""
    try:
        if kind == "json_object":
            return _json_lark({"type": "object"})
        if kind == "json_schema":
            if not isinstance(value, dict):
                raise GrammarError("a JSON schema must be an object")
            return _json_lark(value)
        if kind == "regex":
            if not isinstance(value, str) or not value:
                raise GrammarError("a regex must be a non-empty string")
            return str(llguidance.LLMatcher.grammar_from_regex(value))
        if kind == "choice":
            if (not isinstance(value, list) or not value
                    or not all(isinstance(c, str) and c for c in value)):
                raise GrammarError("choices must be a non-empty list of non-empty strings")
            return str(llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in value)))
        if kind == "grammar":
            if not isinstance(value, str) or not value:
                raise GrammarError("a grammar must be a non-empty string")
            return str(llguidance.grammar_from("grammar", value))  # Lark or GBNF
    except (ValueError, TypeError) as exc:
        if isinstance(exc, GrammarError):
            raise
        raise GrammarError(str(exc)) from None
    raise GrammarError(f"unknown guide kind {kind!r}; one of {', '.join(GUIDE_KINDS)}")


def _json_lark(schema: dict[str, Any]) -> str:
    # llguidance's JSON compiler allows whitespace between tokens but not before the value.
    body = json.dumps(schema)
    return str(llguidance.LLMatcher.grammar_from_lark(
        f"start: LEADING_SPACE? value\nLEADING_SPACE: /[ \\t\\n]+/\nvalue: %json {body}\n"))


def validate(grammar: str, tokenizer: llguidance.LLTokenizer) -> None:
    """Raise GrammarError naming the problem if the grammar does not compile: llguidance's
    report as it gives it ("at line(column): why", then the grammar's lines around it; the
    gateway says it in a user's terms: gateway/structured.py user_reason)."""
    if len(grammar) > MAX_GUIDE_CHARS:
        raise GrammarError(f"the grammar is longer than {MAX_GUIDE_CHARS} characters")
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise GrammarError(error.strip()[:4000])


class _VocabularyBytes:
    """A WordPiece vocabulary (words joined by spaces, "##" pieces glued to the token before)
    as llguidance's TokenizerWrapper wants it: each token's bytes as it reads in running text
    ("word" -> b" word", "##ece" -> b"ece"), and a tokenizer whose tokens' bytes add up to
    exactly the text it is given (llguidance relies on that when a grammar forces bytes).

    One extra id, `space`, stands for a lone b" " (a forced space before a word the grammar has
    not decided yet); it is past the tokenizer's ids and the engine never lets it be sampled.
    """

    def __init__(self, spec: dict[str, Any], eos_id: int, vocab_size: int | None) -> None:
        vocab: dict[str, int] = dict(spec["model"]["vocab"])
        prefix = spec.get("decoder", {}).get("prefix", "##")
        specials = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        self.space = max(vocab.values()) + 1
        size = max(self.space + 1, vocab_size or 0)
        # ids past the tokenizer's (padding rows of the model's logits): specials, never allowed
        self.tokens: list[bytes] = [f"<evenflow-pad-{i}>".encode() for i in range(size)]
        self.tokens[self.space] = b" "
        self.words: dict[str, int] = {}
        self.pieces: dict[str, int] = {}
        for text, token_id in vocab.items():
            if token_id in specials:
                self.tokens[token_id] = text.encode()
            elif text.startswith(prefix):
                self.tokens[token_id] = text[len(prefix):].encode()
                self.pieces[text[len(prefix):]] = token_id
            else:
                self.tokens[token_id] = b" " + text.encode()
                self.words[text] = token_id
        self.special_token_ids = sorted(specials | set(range(self.space + 1, size)))
        self.eos_token_id = eos_id
        self.bos_token_id = None  # (llguidance's attribute; grammars never start with it)
        self._longest = max(map(len, [*self.words, *self.pieces]), default=1)

    def __call__(self, data: bytes | str) -> list[int]:
        text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
        ids: list[int] = []
        at = 0
        while at < len(text):
            if text[at] == " ":
                table, at = self.words, at + 1
                if at == len(text) or text[at] == " ":
                    ids.append(self.space)
                    continue
            else:
                table = self.pieces
            for size in range(min(self._longest, len(text) - at), 0, -1):
                token_id = table.get(text[at : at + size])
                if token_id is not None:
                    ids.append(token_id)
                    at += size
                    break
            else:  # a character the vocabulary cannot spell here: llguidance only needs a
                at += 1  # best effort for such text
        return ids


@dataclass(frozen=True)
class GuideVocabulary:
    """A checkpoint's vocabulary for llguidance: the tokenizer, how many int32 words one row of
    its token bitmask has, and the ids it knows that must never be sampled (pseudo tokens)."""

    tokenizer: llguidance.LLTokenizer
    mask_words: int
    never_sampled: tuple[int, ...]


_CACHE: dict[tuple[str, int], GuideVocabulary] = {}
_LOCK = threading.Lock()


def guide_vocabulary(model_dir: str | Path, eos_ids: Sequence[int],
                     vocab_size: int | None = None) -> GuideVocabulary:
    """The checkpoint's vocabulary for llguidance, at least `vocab_size` wide (the model's
    logits may be wider than the tokenizer; the extra ids are never allowed). Built once per
    process (~1 s for a 150k-token byte-level vocabulary)."""
    path = Path(model_dir) / "tokenizer.json"
    key = (str(path.resolve()), vocab_size or 0)
    with _LOCK:
        cached = _CACHE.get(key)
        if cached is not None:
            return cached
        text = path.read_text()
        spec = json.loads(text)
        eos = list(eos_ids)
        never: tuple[int, ...] = ()
        if spec.get("decoder", {}).get("type") == "WordPiece":
            vocabulary = _VocabularyBytes(spec, eos[0], vocab_size)
            built = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary),
                                           eos_token=eos)
            never = (vocabulary.space,)
        else:  # byte-level BPE, SentencePiece, ...: llguidance reads tokenizer.json itself
            built = llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
        result = GuideVocabulary(built, (built.vocab_size + 31) // 32, never)
        _CACHE[key] = result
        return result
