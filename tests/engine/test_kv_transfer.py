"""A prompt prefilled by one engine and continued by another (its K/V exported and imported)
gives the same tokens as one engine doing both, greedy and seeded."""

from __future__ import annotations

import pytest
from checkpoints import make_checkpoint, prefill_then_decode, run_all

from evenflow import SamplingParams
from evenflow.engine.serving.engine import Engine, EngineConfig


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    make_checkpoint("qwen3_moe", path)
    return path


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=11, max_tokens=20, ignore_eos=True),
])
def test_disaggregated_equals_single_engine(ckpt, params):
    cfg = EngineConfig(model=str(ckpt), dtype="float32", block_size=4)
    prompts = {"a": list(range(3, 40)), "b": list(range(50, 58)), "c": [9, 8, 7]}
    # (the decode engine has a neighbour already decoding when the prompts arrive)
    expected, handed_over, kvs = prefill_then_decode(cfg, prompts, params,
                                                     neighbour=list(range(100, 120)))
    for rid, p in prompts.items():
        assert kvs[rid].shape[0] == -(-len(p) // 4)  # the prompt's blocks
    assert handed_over == expected


def test_mismatched_kv_is_rejected(ckpt):
    engine = Engine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4))
    engine.add_request("a", list(range(3, 12)), SamplingParams(max_tokens=1), export_kv=True)
    _, kvs = run_all(engine)
    with pytest.raises(ValueError, match="does not match"):
        engine.add_prefilled_request("b", list(range(3, 20)), 5, SamplingParams(), kvs["a"])


def test_first_token_is_out_before_its_kv_is_copied(ckpt):
    """The prefill worker sends the first token while the next engine step copies the K/V."""
    engine = Engine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4))
    free = engine.blocks.num_free_blocks
    engine.add_request("a", list(range(3, 12)), SamplingParams(max_tokens=1), export_kv=True)
    [first] = engine.step()
    assert first.new_token_ids and first.finished and first.kv is None and first.kv_follows
    [export] = engine.step()
    assert export.request_id == "a" and not export.new_token_ids
    assert export.kv is not None and export.kv.shape[0] == 3  # 9 prompt tokens, blocks of 4
    assert not engine.has_unfinished()
    assert engine.blocks.num_free_blocks == free  # the blocks were held only until the copy


def test_native_block_copies_equal_torch(ckpt, monkeypatch):
    """kernels/kv_blocks.cpp reads and writes exactly what torch's per-layer index ops do."""
    import torch

    from evenflow.engine.kernels import native

    if native.kv_blocks() is None:
        pytest.skip("native kernels unavailable")
    runner = Engine(EngineConfig(model=str(ckpt), dtype="bfloat16", block_size=4)).runner
    for k, v in runner.kv_caches:
        k.copy_(torch.randn(k.shape))
        v.copy_(torch.randn(v.shape))
    blocks = [7, 2, 30, 3]  # out of order, as a block table can be
    native_read = runner.read_kv(blocks)
    payload = torch.randn(native_read.shape).to(torch.bfloat16)
    runner.write_kv([11, 5, 40, 6], payload)
    native_written = runner.read_kv([11, 5, 40, 6])
    monkeypatch.setattr(native, "kv_blocks", lambda: None)
    assert torch.equal(runner.read_kv(blocks), native_read)
    assert torch.equal(runner.read_kv([11, 5, 40, 6]), native_written)
    assert torch.equal(native_written, payload)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_pulled_prefix_is_a_prefix_hit_with_identical_output(ckpt, kv_cache_dtype):
    """A holder's cached blocks of a conversation, pulled into another engine's prefix cache:
    the next turn there computes only the rest and samples what the holder samples."""
    cfg = EngineConfig(model=str(ckpt), dtype="float32", block_size=4,
                       kv_cache_dtype=kv_cache_dtype)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    holder, puller = Engine(cfg), Engine(cfg)
    history = list(range(3, 30))
    holder.add_request("turn1", history, greedy)
    answer, _ = run_all(holder)
    puller.add_request("own", history[:9], SamplingParams(max_tokens=1))  # 2 blocks of its own
    run_all(puller)
    turn2 = history + answer["turn1"] + [7, 8, 9]
    own = puller.prefix.cached_prefix_blocks(turn2)
    assert own == 2 and holder.prefix.cached_prefix_blocks(turn2) == (len(turn2) - 1) // 4 - 1
    usable = (len(turn2) - 1) // 4  # blocks the prompt can take from a cache
    kv = holder.prefix.export_prefix(turn2[: usable * 4], own)  # as a puller asks
    assert kv.num_blocks == holder.prefix.cached_prefix_blocks(turn2) - own
    assert puller.prefix.import_prefix(turn2, own, kv) == kv.num_blocks
    assert puller.prefix.cached_prefix_blocks(turn2) == own + kv.num_blocks
    events = puller.prefix.take_kv_events() if puller.prefix.collect_events \
        else puller.blocks.take_events()
    assert any(getattr(e, "block_hashes", None) for e in events)  # the index hears of them
    holder.add_request("turn2", turn2, greedy)
    puller.add_request("turn2", turn2, greedy)
    expected, _ = run_all(holder)
    [first] = puller.step()
    assert first.num_cached_tokens == (own + kv.num_blocks) * 4  # computed only the rest
    got, _ = run_all(puller)
    assert first.new_token_ids + got["turn2"] == expected["turn2"]
    assert holder.prefix.export_prefix(turn2, 10**6).num_blocks == 0  # past the end: nothing
    assert holder.prefix.export_prefix(history[:24], 0).num_blocks == 6  # every block asked for


def test_pulled_kv_of_another_layout_is_refused(ckpt):
    a = Engine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4))
    b = Engine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4,
                            kv_cache_dtype="int8"))
    prompt = list(range(3, 20))
    a.add_request("x", prompt, SamplingParams(max_tokens=1))
    run_all(a)
    with pytest.raises(ValueError, match="does not match"):
        b.prefix.import_prefix(prompt, 0, a.prefix.export_prefix(prompt, 0))
    assert b.prefix.cached_prefix_blocks(prompt) == 0
    with pytest.raises(ValueError, match="negative"):  # never blocks counted from the end
        a.prefix.export_prefix(prompt, -2)
