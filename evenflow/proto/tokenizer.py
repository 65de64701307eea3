"""The text <-> token-id contract: a checkpoint's tokenizer.json and chat template, and the
incremental detokenizer with stop strings.

Torch-free on purpose: the gateway tokenizes and detokenizes, the engine only sees token ids, and
the offline `LLM` uses the same code so both sides agree on every byte.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer


class TokenizerError(ValueError):
    """A tokenizer file is missing or unreadable, or a chat template failed to render."""


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config.json files
        return value.get("content")
    return value


def _raise_exception(message: str) -> None:
    raise TokenizerError(f"chat template: {message}")


class Tokenizer:
    """tokenizer.json + tokenizer_config.json of a checkpoint directory."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{model_dir}: tokenizer.json is missing")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust error names the problem; keep it
            raise TokenizerError(f"{path}: cannot load tokenizer ({exc})") from exc
        config: dict[str, Any] = {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except ValueError as exc:
                raise TokenizerError(f"{config_path}: invalid JSON ({exc})") from exc
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template: str | None = config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take "default"
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default")
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._template: jinja2.Template | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, context_ids: Sequence[int], skip_special_tokens: bool = True
                      ) -> Callable[[int], str | None] | None:
        """tokenizers' DecodeStream (incremental, in Rust: one call a token), seeded with the
        tokens before the output, as a function of the next token id; None where this
        tokenizers release has none."""
        try:
            from tokenizers.decoders import DecodeStream

            stream = DecodeStream(ids=list(context_ids), skip_special_tokens=skip_special_tokens)
        except (ImportError, TypeError):
            return None
        backend = self._tok
        return lambda token_id: stream.step(backend, token_id)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """Render the checkpoint's chat template, the way transformers does (`extra`: a
        request's chat_template_kwargs, such as Qwen3's enable_thinking)."""
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template; use the completions API")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(
                **(extra or {}),
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools or None,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        # The template writes the special tokens itself, as transformers assumes.
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


# How many prompt tokens seed the detokenizer, so the first output token decodes with the
# leading space or byte context it has in the full text.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, applying stop strings.

    `add(ids)` returns the newly printable text. Text that might still become part of a stop
    string, or an incomplete UTF-8 sequence, is held back until it is decided. Once a stop string
    appears, `stopped` is True and the text is cut before it (or after it, with include_stop).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = [s for s in stop if s]
        self._include_stop = include_stop
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # all decoded output text, after stop handling
        self._emitted = 0  # how much of self.text has been returned
        self.stopped = False
        # With no stop string (no rewind, nothing held back), tokenizers' own incremental
        # decoder, ~4x cheaper a token, the same text (checked on random ids of byte-level and
        # SentencePiece vocabularies: tests/unit/test_direct_stream.py).
        self._step = None if self._stop else tokenizer.decode_stream(self._ids,
                                                                     skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        step = self._step
        if step is not None:
            pieces = [piece for token_id in token_ids if (piece := step(token_id))]
            if pieces:
                self.text += "".join(pieces)
            return self._take(final=False)
        for token_id in token_ids:
            self._ids.append(token_id)
            prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset],
                                      self._skip_special)
            full = self._tok.decode(self._ids[self._prefix_offset :], self._skip_special)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix) :]
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._ids)
            if self._stop and self._check_stop():
                break
        return self._take(final=self.stopped)

    def mark(self) -> tuple[int, int, int, str, int]:
        """Where the detokenizer stands, to `rewind` to (cheap: no copy)."""
        return (len(self._ids), self._prefix_offset, self._read_offset, self.text,
                self._emitted)

    def rewind(self, mark: tuple[int, int, int, str, int]) -> None:
        """Back to a `mark`, as if what was added since never came."""
        n, self._prefix_offset, self._read_offset, self.text, self._emitted = mark
        del self._ids[n:]
        self.stopped = False

    def flush(self) -> str:
        """The held-back text, when the sequence has finished."""
        return self._take(final=True)

    def _check_stop(self) -> bool:
        search_from = max(0, self._emitted - self._hold)
        best: tuple[int, str] | None = None
        for s in self._stop:
            at = self.text.find(s, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return False
        at, s = best
        self.text = self.text[: at + len(s)] if self._include_stop else self.text[:at]
        self.stopped = True
        return True

    def _take(self, final: bool) -> str:
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
