"""Deterministic mode (EngineConfig.deterministic): a position's K/V and logits do not depend on
how it was scheduled. A stream re-prefilled after a migration (prompt + the tokens it already
has, on an engine that never saw it) continues exactly as the uninterrupted run, in the
machine's native dtype (bf16 where the CPU has it); so does a prompt prefilled in chunks or
beside other requests."""

from __future__ import annotations

import pytest

from evenflow import SamplingParams
from evenflow.engine.config.settings import cpu_has_bf16
from evenflow.engine.serving.engine import Engine, EngineConfig

DTYPE = "bfloat16" if cpu_has_bf16() else "float32"
PROMPT = list(range(5, 40))
TOKENS = 300


def engine(**more) -> Engine:
    return Engine(EngineConfig(dtype=DTYPE, num_threads=2, enable_prefix_caching=False,
                               deterministic=True, **more))


def generate(e: Engine, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for rid, prompt in prompts.items():
        e.add_request(rid, prompt, params)
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while e.has_unfinished():
        for o in e.step():
            out[o.request_id].extend(o.new_token_ids)
    return out


@pytest.fixture(scope="module")
def uninterrupted():
    return generate(engine(), {"full": PROMPT}, TOKENS)["full"]


@pytest.mark.parametrize("k", [1, 60, 180])
def test_a_re_prefilled_stream_continues_exactly(uninterrupted, k):
    """What a migration does: another engine prefills prompt + k generated tokens and goes on
    (without the mode, bf16 output left the uninterrupted run's near token 180 here)."""
    rest = generate(engine(), {"moved": PROMPT + uninterrupted[:k]}, TOKENS - k)["moved"]
    assert rest == uninterrupted[k:]


def test_chunked_prefill_and_neighbours_change_nothing(uninterrupted):
    e = engine(max_num_batched_tokens=16)  # the prompt in three chunks, shared with others
    out = generate(e, {"full": PROMPT, "a": list(range(100, 171)), "b": [7] * 20}, TOKENS)
    assert out["full"] == uninterrupted


def test_refused_where_it_cannot_hold():
    with pytest.raises(ValueError, match="deterministic"):
        EngineConfig(deterministic=True, quantization="int8")
