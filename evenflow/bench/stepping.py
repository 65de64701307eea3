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
    from evenflow.proto.sampling import SamplingParams

    params = params or SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(str(next(ids)), p, params)
    steps = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return steps


def decode_blocks(batch: int, context: int, steps: int, block_size: int = 16) -> int:
    """KV blocks for `batch` sequences of `context` tokens decoding `steps` more."""
    return batch * -(-(context + steps + 8) // block_size)


def alternating_decode(engines: dict[str, Any], batch: int, context: int, rounds: int,
                       steps: int, ids: Iterator[int]) -> dict[str, list[float]]:
    """Each engine gets the same `batch` prompts of `context` tokens, prefilled untimed (and
    one warm-up decode step); then `rounds` rounds in which each engine in turn decodes
    `steps` steps: per engine, each round's median ms/step."""
    import statistics

    from evenflow.proto.sampling import SamplingParams

    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=rounds * steps + 4)
    for engine in engines.values():
        for p in random_prompts(batch, context, engine.model_config.vocab_size, batch):
            engine.add_request(str(next(ids)), p, params)
        while engine.num_waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                        for s in engine.scheduler.running):
            engine.step()
        engine.step()
    result: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            result[name].append(statistics.median(times) * 1e3)
    return result
