"""Head dims no native kernel was built for run torch's path instead (said once in the log),
never crash: greedy tokens equal transformers' through prefill, decode and the prefix cache."""

from __future__ import annotations

import logging

import pytest
import torch
from checkpoints import VOCAB, hf_greedy, make_checkpoint

from evenflow import LLM, SamplingParams

NEW_TOKENS = 12


@pytest.mark.parametrize("head_dim", [40, 80, 96, 120])
def test_any_head_dim_runs_and_matches_transformers(tmp_path, head_dim, caplog):
    hf = make_checkpoint("qwen3_moe", tmp_path, overrides=dict(head_dim=head_dim))
    hf.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(head_dim)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 37, 130)]
    llm = LLM(str(tmp_path), dtype="float32", block_size=16)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    expected = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    with caplog.at_level(logging.INFO, logger="evenflow.engine.kernels.native"):
        first = llm.generate(prompts, params)
        again = llm.generate(prompts, params)  # the prompts' blocks from the prefix cache
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in again] == expected
    assert [o.num_cached_tokens for o in again] == [0, 32, 128]  # whole 16-token blocks
