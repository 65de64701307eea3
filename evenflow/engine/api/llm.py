"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`.

Tokenizes text prompts, drives the engine until every request finishes, and detokenizes with
stop strings, returning results in prompt order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, fields
from typing import Any, cast

from evenflow.engine.dep.offline import DEPEngine
from evenflow.engine.serving.engine import Engine, EngineConfig
from evenflow.progress import on_terminal
from evenflow.proto.sampling import SamplingParams
from evenflow.proto.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_cached_tokens: int


class LLM:
    """An engine plus the checkpoint's tokenizer. Keyword arguments are EngineConfig fields."""

    def __init__(self, model: str = "tiny-moe", **engine_args: Any) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise TypeError(f"unknown LLM argument(s) {unknown}; known: {sorted(known)}")
        engine_args.setdefault("show_progress", on_terminal())
        config = EngineConfig(model=model, **engine_args)
        self.engine: Engine | DEPEngine = (
            DEPEngine(config) if config.expert_parallel_size > 1 else Engine(config))
        self.tokenizer = Tokenizer(self.engine.model_dir)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Seq[str] | Seq[Seq[int]] | str,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        outputs: dict[str, RequestOutput] = {}
        detoks: dict[str, IncrementalDetokenizer] = {}
        order: list[str] = []
        try:
            for prompt, p in zip(prompts, per_prompt, strict=True):
                text = prompt if isinstance(prompt, str) else None
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(
                    cast("Seq[int]", prompt))
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, ids, p)
                order.append(request_id)
                outputs[request_id] = RequestOutput(request_id, text, ids, [], "", None, 0)
                detoks[request_id] = IncrementalDetokenizer(
                    self.tokenizer, ids, p.stop, p.include_stop_str_in_output)
            while self.engine.has_unfinished():
                for step in self.engine.step():
                    out, detok = outputs[step.request_id], detoks[step.request_id]
                    if detok.stopped:  # (a draft's later tokens, after a stop string)
                        continue
                    out.token_ids.extend(step.new_token_ids)
                    out.num_cached_tokens = step.num_cached_tokens
                    detok.add(step.new_token_ids)
                    if detok.stopped and not step.finished:
                        self.engine.abort(step.request_id)
                        out.finish_reason = "stop"
                    elif step.finished and out.finish_reason is None:
                        out.finish_reason = step.finish_reason.value if step.finish_reason else None
        except BaseException:
            for request_id in order:
                self.engine.abort(request_id)
            raise
        for request_id in order:
            detoks[request_id].flush()
            outputs[request_id].text = detoks[request_id].text
        return [outputs[r] for r in order]

    def chat(self, messages: list[dict[str, Any]], sampling_params: SamplingParams | None = None
             ) -> RequestOutput:
        """One chat turn through the checkpoint's chat template."""
        return self.generate([self.tokenizer.encode_chat(messages)], sampling_params)[0]
