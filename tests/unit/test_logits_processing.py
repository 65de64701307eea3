"""Penalties, logit_bias, allowed_token_ids, min_tokens, min_p and logprobs in the sampler, on
hand-made logits: each changes exactly the tokens it should."""

from __future__ import annotations

import math

import torch

from evenflow.engine.core.sequence import Sequence
from evenflow.engine.sample.sampler import sample
from evenflow.proto.sampling import SamplingParams

GREEDY = dict(temperature=0)


def seq(params: SamplingParams, prompt: list[int], output: list[int]) -> Sequence:
    s = Sequence("r", prompt + output, len(prompt), params)
    return s


def test_presence_and_frequency_penalties_push_repeated_tokens_down():
    logits = torch.tensor([[0.0, 0.0, 0.0, 2.5, 0.0, 2.0]])
    repeated = seq(SamplingParams(presence_penalty=0.5, frequency_penalty=0.75, **GREEDY),
                   [1], [3, 3, 5])
    plain = seq(SamplingParams(**GREEDY), [1], [3, 3, 5])
    # token 3: 2.5 - 0.5 - 2 * 0.75 = 0.5; token 5: 2.0 - 0.5 - 0.75 = 0.75; the rest stay 0
    assert sample(logits.repeat(2, 1), [repeated, plain]) == [5, 3]
    heavier = seq(SamplingParams(frequency_penalty=2.0, **GREEDY), [1], [3, 3, 5])
    assert sample(logits, [heavier]) == [0]  # 3 -> -1.5, 5 -> 0.0: token 0 (first of the zeros)


def test_repetition_penalty_covers_the_prompt_and_divides_positive_logits():
    logits = torch.tensor([[0.0, 3.0, 2.0, 0.5]])
    s = seq(SamplingParams(repetition_penalty=2.0, **GREEDY), [1], [])
    assert sample(logits, [s]) == [2]  # token 1 (in the prompt): 3.0 / 2 = 1.5 < 2.0


def test_logit_bias_allowed_tokens_and_min_tokens():
    logits = torch.tensor([[5.0, 1.0, 0.0, 0.0, 4.0]])
    assert sample(logits, [seq(SamplingParams(logit_bias={3: 10.0}, **GREEDY), [1], [])]) == [3]
    assert sample(logits, [seq(SamplingParams(allowed_token_ids=[1, 2], **GREEDY), [1], [])]) \
        == [1]
    # EOS (token 0 here) and stop token 4 are masked until two tokens have been produced
    early = seq(SamplingParams(min_tokens=2, stop_token_ids=[4], **GREEDY), [1], [2])
    late = seq(SamplingParams(min_tokens=2, stop_token_ids=[4], **GREEDY), [1], [2, 2])
    assert sample(logits.repeat(2, 1), [early, late], eos_ids={0}) == [1, 0]


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).repeat(300, 1)
    out = sample(logits, [seq(SamplingParams(min_p=0.4), [1], []) for _ in range(300)])
    assert set(out) == {0, 1}  # 0.1 < 0.4 * 0.6


def test_logprobs_are_consistent_with_the_greedy_choice():
    logits = torch.randn(2, 30)
    asks = seq(SamplingParams(logprobs=3, **GREEDY), [1], [])
    quiet = seq(SamplingParams(**GREEDY), [1], [])
    (token, _) = sample(logits, [asks, quiet])
    assert asks.step_logprobs is not None and quiet.step_logprobs is None
    lp = asks.step_logprobs
    chosen, top_ids, top_values = lp.logprob, lp.top_ids, lp.top_logprobs
    assert top_ids[0] == token and len(top_ids) == 3
    assert math.isclose(chosen, top_values[0], rel_tol=1e-6)
    assert math.isclose(chosen, torch.log_softmax(logits[0], -1)[token].item(), rel_tol=1e-5)
    assert top_values == sorted(top_values, reverse=True)
