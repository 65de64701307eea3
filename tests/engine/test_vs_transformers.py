"""Greedy generation is token-identical to transformers for every supported architecture,
including prefix-cache hits, preemption, chunked prefill and requests arriving mid-decode."""

from __future__ import annotations

import re

import pytest
import torch
from checkpoints import ARCHS, VOCAB, hf_greedy, make_checkpoint, run_with_arrivals

from evenflow import LLM, SamplingParams
from evenflow.engine.serving.engine import Engine, EngineConfig

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(request.param, path)
    hf.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    return path, hf


def reference(hf, prompt: list[int]) -> list[int]:
    return hf_greedy(hf, prompt, NEW_TOKENS)


def random_prompts(lengths, seed=1, prefix: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [(prefix or []) + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def test_batch_of_different_lengths(checkpoint):
    path, hf = checkpoint
    prompts = random_prompts([1, 5, 17, 40, 77])
    outs = LLM(str(path), dtype="float32", block_size=16).generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference(hf, prompt)
        assert out.finish_reason == "length"


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (8, 2)])
def test_head_dim_64_at_a_batch_of_twelve(tmp_path, heads, kv_heads):
    """Heads of 64 with 2 or 4 queries per KV head: the paged attention's register path, which
    the engine takes at any batch size on AVX-512 builds (torch's path elsewhere)."""
    hf = make_checkpoint("llama", tmp_path, overrides=dict(
        hidden_size=64 * heads, num_attention_heads=heads, num_key_value_heads=kv_heads))
    hf.generation_config.eos_token_id = None
    prompts = random_prompts([3 + 7 * i for i in range(12)], seed=5)
    outs = LLM(str(tmp_path), dtype="float32", block_size=16).generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference(hf, prompt)


# the families issue 30 names, and the sliding windows (the rest run the shorter prompts above)
LONG_PROMPT_ARCHS = {"deepseek_v3", "deepseek_v3_yarn", "deepseek_v2", "gpt_oss", "olmoe",
                     "llama3", "qwen2", "mistral", "glm4_moe", "mistral_window",
                     "qwen2_window"}


def test_prompts_up_to_260_tokens_twice(checkpoint):
    """5 to 260 tokens, then the same prompts again: the second pass reads every full block
    from the prefix cache and must not change a token."""
    path, hf = checkpoint
    if not any(re.fullmatch(rf"{arch}\d+", path.name) for arch in LONG_PROMPT_ARCHS):
        pytest.skip("covered by the shorter prompts on this family")
    prompts = random_prompts([5, 64, 131, 260], seed=11)
    want = [reference(hf, prompt) for prompt in prompts]
    llm = LLM(str(path), dtype="float32", block_size=16)
    for again in (False, True):
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == want
        if again:
            assert [o.num_cached_tokens for o in outs] == [0, 48, 128, 256]


def test_shared_prefix_hits_cache(checkpoint):
    path, hf = checkpoint
    prefix = random_prompts([40], seed=7)[0]
    prompts = random_prompts([3, 9, 20], seed=2, prefix=prefix)
    llm = LLM(str(path), dtype="float32", block_size=8)
    first = llm.generate(prompts[:1], GREEDY)[0]
    rest = llm.generate(prompts[1:], GREEDY)
    assert first.num_cached_tokens == 0
    for prompt, out in zip(prompts[1:], rest, strict=True):
        assert out.num_cached_tokens == 40  # five full blocks of the shared prefix
        assert out.token_ids == reference(hf, prompt)


def test_a_burst_sharing_a_new_prefix_computes_it_once(checkpoint):
    path, hf = checkpoint
    prefix = random_prompts([40], seed=8)[0]
    prompts = random_prompts([3, 9, 20], seed=5, prefix=prefix)
    outs = LLM(str(path), dtype="float32", block_size=8).generate(prompts, GREEDY)
    # Submitted together: the first computes the prefix, the others wait a step and hit it.
    assert [o.num_cached_tokens for o in outs] == [0, 40, 40]
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference(hf, prompt)


def test_preemption_when_blocks_run_out(checkpoint):
    path, hf = checkpoint
    prompts = random_prompts([20, 30, 25, 12], seed=3)
    # 4 sequences of up to 62 tokens need 16 blocks of 16; give them 9.
    llm = LLM(str(path), dtype="float32", block_size=16, num_kv_blocks=9)
    outs = llm.generate(prompts, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == reference(hf, prompt)


def test_arrivals_while_decoding_with_chunked_prefill(checkpoint):
    path, hf = checkpoint
    prompts = random_prompts([33, 6, 50, 14], seed=4)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", block_size=4,
                                 max_num_batched_tokens=24))
    # prompt 0 is chunked (33 > 24) and then decodes while 1, 2 and then 3 arrive
    produced = run_with_arrivals(engine, prompts, GREEDY, arrivals=[0, 5, 5, 7])
    for prompt, tokens in zip(prompts, produced, strict=True):
        assert tokens == reference(hf, prompt)
