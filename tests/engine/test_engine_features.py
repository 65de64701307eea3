"""Engine behaviours a caller relies on: expert-load counters, seeded sampling independent of
the batch, stop strings and tokens, abort, and KV events."""

from __future__ import annotations

import pytest
from checkpoints import make_checkpoint

from evenflow import LLM, SamplingParams
from evenflow.engine.serving.engine import Engine, EngineConfig
from evenflow.proto.messages import BlockRemoved, BlockStored


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_moe")
    make_checkpoint("qwen2_moe", path)  # layer 0 sparse, layer 1 dense
    return path


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), dtype="float32", block_size=4)


def test_expert_counts_cover_every_routed_token(llm):
    llm.engine.take_expert_counts()
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    counts = llm.engine.take_expert_counts()
    assert counts.shape == (1, 4)  # one MoE layer, four experts
    tokens = 8 + 2 * 3  # both prompts, then 3 decode steps each (the 4th token is not fed back)
    assert int(counts.sum()) == tokens * 2  # top-2
    assert int(llm.engine.take_expert_counts().sum()) == 0  # reading resets


def test_seeded_sampling_ignores_batch_neighbours(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate([[5, 6, 7]], params)[0].token_ids
    crowd = llm.generate([[9, 9, 9, 9], [5, 6, 7], [40, 41]],
                         [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
                          params, SamplingParams(seed=3, max_tokens=5, ignore_eos=True)])
    assert crowd[1].token_ids == alone
    again = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, seed=99, max_tokens=12,
                                                     ignore_eos=True))[0]
    assert again.token_ids != alone  # another seed, another sample


def test_stop_token_and_stop_string(llm):
    base = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10,
                                                    ignore_eos=True))[0]
    third = base.token_ids[2]
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10,
                                                   stop_token_ids=[third], ignore_eos=True))[0]
    assert out.token_ids == base.token_ids[: base.token_ids.index(third) + 1]
    assert out.finish_reason == "stop"
    words = base.text.split()
    cut = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                   stop=[words[3]]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == base.text[: base.text.index(words[3])]


def test_abort_frees_blocks_and_reports(ckpt):
    events = []
    engine = Engine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4,
                                 num_kv_blocks=16), kv_event_listener=events.extend)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("a", list(range(3, 20)), params)
    engine.step()
    engine.step()
    assert engine.abort("a")
    outs = engine.step()
    assert [(o.request_id, o.finished, o.finish_reason.value) for o in outs] == [
        ("a", True, "abort")]
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == 16
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert len(stored) == 4  # 18 computed tokens: four full blocks
    # New work evicts the freed cached blocks, and each eviction is reported.
    engine.add_request("b", list(range(100, 161)), params)
    engine.step()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert set(removed) == set(stored)
