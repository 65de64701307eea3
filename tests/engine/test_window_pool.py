"""A hybrid model's sliding-window layers keep their K/V in a pool of their own that holds only
the window (engine/core/window_blocks.py): a long generation holds a few blocks there whatever
its length, the other pool gets the memory back, the output stays token-identical to
transformers and to the engine without the pool (EVENFLOW_WINDOW_POOL=0), through prefix hits,
preemption and the prefill -> decode hand-off."""

from __future__ import annotations

import pytest
import torch
from checkpoints import VOCAB, hf_greedy, make_checkpoint, prefill_then_decode

from evenflow import LLM, SamplingParams
from evenflow.engine.core.window_blocks import NO_BLOCK
from evenflow.engine.serving.engine import Engine, EngineConfig

WINDOW, BLOCK = 8, 4  # GPT-OSS's test config: a sliding layer (window 8), then a full one


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    hf = make_checkpoint("gpt_oss", path)
    hf.generation_config.eos_token_id = None
    return path, hf


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_long_generation_holds_only_the_window_and_matches_transformers(gpt_oss):
    path, hf = gpt_oss
    tokens = prompt(37)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", block_size=BLOCK))
    pool = engine.blocks.window_pool
    assert pool is not None and pool.window == WINDOW
    engine.add_request("a", tokens, SamplingParams(temperature=0, max_tokens=60,
                                                   ignore_eos=True))
    seq = engine._requests["a"]
    held, out = [], []
    while engine.has_unfinished():
        for o in engine.step():
            out += o.new_token_ids
        if not seq.is_finished:
            held.append(sum(1 for b in seq.window_table if b != NO_BLOCK))
    assert out == hf_greedy(hf, tokens, 60)
    # decode holds the window's blocks and the one the next token opens, never the whole context
    assert max(held[1:]) <= WINDOW // BLOCK + 2 < len(seq.block_table or [0] * 25)
    assert pool.num_free_blocks == pool.num_blocks  # all given back


def test_the_full_layers_pool_gets_the_memory_back(gpt_oss, monkeypatch):
    path, _ = gpt_oss
    config = EngineConfig(model=str(path), dtype="float32", block_size=BLOCK,
                          kv_cache_gb=0.0002, max_num_seqs=4, max_num_batched_tokens=64)
    pooled = Engine(config)
    monkeypatch.setenv("EVENFLOW_WINDOW_POOL", "0")
    shared = Engine(config)
    assert shared.blocks.window_pool is None
    # one full layer of two: twice the blocks for the same bytes, less what the window pool
    # takes (4 sequences' windows and one step's chunk: 35 blocks of one layer)
    window = pooled.blocks.window_pool
    assert window is not None and window.num_blocks == 4 * (WINDOW // BLOCK + 3) + 64 // BLOCK
    assert pooled.num_kv_blocks >= 2 * shared.num_kv_blocks - window.num_blocks - 1


@pytest.mark.parametrize("blocks", [40, 200])
def test_same_tokens_without_the_pool_through_hits_and_preemption(gpt_oss, monkeypatch, blocks):
    """40 blocks: preemptions (4 sequences of up to 70 tokens need 72). 200: the shared prefix
    of 24 tokens is a hit, as its sliding-layer blocks are still cached (with 40, given back
    once behind the window while the prompt still ran, they are evicted by the time it is
    asked again)."""
    path, _ = gpt_oss
    prompts = [prompt(n, seed) for n, seed in ((30, 2), (45, 3), (21, 4), (33, 5))]
    shared_prefix = prompts[1][:24] + prompt(10, 6)
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)

    def outputs() -> tuple[list[list[int]], int, int]:
        llm = LLM(str(path), dtype="float32", block_size=BLOCK, num_kv_blocks=blocks)
        first = [o.token_ids for o in llm.generate(prompts, params)]
        again = llm.generate([shared_prefix], params)[0]
        return first + [again.token_ids], again.num_cached_tokens, \
            llm.engine.scheduler.num_preemptions

    pooled, cached, preempted = outputs()
    assert preempted > 0 if blocks == 40 else cached == 24
    monkeypatch.setenv("EVENFLOW_WINDOW_POOL", "0")
    assert outputs()[0] == pooled


def test_prefill_and_decode_engines_hand_the_window_over(gpt_oss):
    path, _ = gpt_oss
    cfg = EngineConfig(model=str(path), dtype="float32", block_size=BLOCK)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = {"a": prompt(37, 7), "b": prompt(9, 8), "c": prompt(3, 9)}
    expected, handed_over, _ = prefill_then_decode(cfg, prompts, params)
    assert handed_over == expected


def test_an_int8_cache_gives_the_same_tokens_with_the_pool(gpt_oss, monkeypatch):
    path, _ = gpt_oss
    prompts = [prompt(n, seed) for n, seed in ((30, 12), (45, 13))]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    def tokens() -> list[list[int]]:
        llm = LLM(str(path), dtype="float32", block_size=BLOCK, kv_cache_dtype="int8")
        return [o.token_ids for o in llm.generate(prompts, params)]

    pooled = tokens()
    monkeypatch.setenv("EVENFLOW_WINDOW_POOL", "0")
    assert tokens() == pooled
