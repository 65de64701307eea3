"""What the offline benchmarks share: random prompts of exact lengths, and driving an engine to
completion while timing every step."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` token ids from 3 up (clear of the specials), seeded."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(count)]


def drive(engine: Any, prompts: list[list[int]], max_tokens: int, ids: Iterator[int],
          params: Any = None) -> list[float]:
    """Add the prompts (greedy, ignore_eos, `max_tokens` each, unless `params`), step until
    every request finished; each step's seconds."""
    from evenflow.engine.core.sampling_params import SamplingParams

    params = params or SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(str(next(ids)), p, params)
    steps = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return steps
