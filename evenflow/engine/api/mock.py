"""The mock engine (`--engine mock`): the real block manager, prefix cache, scheduler and KV
events, with the forward pass replaced by a timing model, so routing and scaling can be
exercised with 8-32 workers on a small machine. Its tokens are a deterministic function of the
sequence, not a model's output."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, fields
from typing import Any

import torch

from evenflow.engine.config.families import load_model_config
from evenflow.engine.config.settings import ModelConfig
from evenflow.engine.core.scheduler import ScheduledChunk
from evenflow.engine.sample.guided import Guides
from evenflow.engine.serving.engine import Engine
from evenflow.proto.engine_values import ServingForm


@dataclass(frozen=True)
class MockTiming:
    prefill_s_per_token: float = 0.0001  # 2,048 uncached tokens: ~0.2 s
    decode_s_base: float = 0.004  # per step with any decoding sequence
    decode_s_per_seq: float = 0.0002
    engine_build_s: float = 0.0  # the real engine's construction (a mock worker waits it out)

    @classmethod
    def from_profile(cls, path: str) -> MockTiming:
        """The step costs a roles profile measured from the real engine (`evenflow
        profile-roles`: a JSON object with these three keys among others)."""
        with open(path) as f:
            measured = json.load(f)
        return cls(**{f.name: float(measured[f.name]) for f in fields(cls)
                      if f.name in measured})


class MockRunner:
    """Stands in for ModelRunner: sleeps for the step's modelled time, emits tokens, holds no KV
    (exported K/V is an empty (blocks, 0) tensor)."""

    def __init__(self, vocab_size: int, timing: MockTiming) -> None:
        self.vocab_size, self.timing = vocab_size, timing
        self.guides: Guides | None = None
        self.expert_counts = torch.zeros(0, 1, dtype=torch.int64)
        self.computed_tokens = 0  # prefill tokens "computed" so far (cache misses)

    def run(self, chunks: list[ScheduledChunk]) -> list[int | torch.Tensor]:
        prefill_tokens = sum(c.num_tokens for c in chunks if c.num_tokens > 1)
        decodes = sum(1 for c in chunks if c.num_tokens == 1)
        self.computed_tokens += prefill_tokens
        t = self.timing
        time.sleep(prefill_tokens * t.prefill_s_per_token
                   + (t.decode_s_base + decodes * t.decode_s_per_seq if decodes else 0.0))
        span = self.vocab_size - 3
        return [3 + (c.seq.token_ids[-1] * 31 + c.seq.num_tokens) % span
                for c in chunks if c.samples]

    def read_kv(self, block_ids: list[int], window_ids: list[int] | None = None
                ) -> torch.Tensor:
        return torch.empty(len(block_ids), 0, dtype=torch.uint8)

    def write_kv(self, block_ids: list[int], kv: torch.Tensor,
                 window_ids: list[int] | None = None) -> None:
        pass

    def kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, 0)


class MockEngine(Engine):
    timing = MockTiming()
    speculates = False  # (its runner scores no drafts)

    def _load(self, dtype: torch.dtype) -> ModelConfig:
        return load_model_config(self.model_dir)  # the config only: no weights

    def _make_runner(self, num_blocks: int, dtype: torch.dtype, window_blocks: int = 0
                     ) -> MockRunner:
        return MockRunner(self.model_config.vocab_size, self.timing)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kernels = MockKernels(self.kv_dtype_name)  # type: ignore[assignment]

    @property
    def kv_dtype(self) -> torch.dtype:
        return torch.uint8


class MockKernels:
    """The mock engine's kernels part: none to run, none to switch to."""

    def __init__(self, kv_dtype_name: str) -> None:
        self.kv_dtype_name = kv_dtype_name

    def summary(self) -> str:
        return "mock engine: a timing model, no kernels"

    def serving_form(self) -> ServingForm:
        return ServingForm("none (mock engine)", self.kv_dtype_name, "none: a timing model")

    @property
    def pending(self) -> bool:
        return False  # (no kernels to switch)

    def switch_when_ready(self) -> str | None:
        return None
