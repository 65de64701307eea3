"""The KV cache's disk tier: blocks evicted from RAM go to disk and come back on a prefix hit
with the same greedy output as when they were computed; a restarted engine keeps the tier
warm, a different model or KV dtype wipes it; the tier's events name their medium."""

from __future__ import annotations

import pytest
from checkpoints import make_checkpoint

from evenflow import SamplingParams
from evenflow.engine.serving.engine import Engine, EngineConfig
from evenflow.proto.messages import BlockStored

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    make_checkpoint("qwen3_moe", path)
    return path


def engine(ckpt, tier, **more):
    settings = dict(model=str(ckpt), dtype="float32", block_size=4, num_kv_blocks=24,
                    kv_disk_dir=str(tier), kv_disk_gb=0.01, **more)
    return Engine(EngineConfig(**settings), collect_kv_events=True)


def generate(e, rid, prompt):
    e.add_request(rid, prompt, GREEDY)
    tokens, cached = [], 0
    while e.has_unfinished():
        for out in e.step():
            tokens.extend(out.new_token_ids)
            cached = out.num_cached_tokens
    return tokens, cached


PROMPT = list(range(3, 43))  # 40 tokens: 10 blocks of 4


def fill_ram(e):
    """Other prompts, enough to evict every free block the first one left."""
    for n in range(3):
        generate(e, f"other{n}", list(range(100 + 50 * n, 140 + 50 * n)))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_evicted_blocks_come_back_from_disk_with_the_same_output(ckpt, tmp_path,
                                                                 kv_cache_dtype):
    e = engine(ckpt, tmp_path / "tier", kv_cache_dtype=kv_cache_dtype)
    first, _ = generate(e, "a", PROMPT)
    fill_ram(e)
    assert e.tiers.saved >= 9
    again, cached = generate(e, "b", PROMPT)
    assert e.tiers.promoted >= 9 and cached >= 36  # the prompt's full blocks, from disk
    assert again == first
    events = e.take_kv_events()
    assert any(isinstance(ev, BlockStored) and ev.medium == "disk" for ev in events)
    no_tier = Engine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4,
                                  num_kv_blocks=24, kv_cache_dtype=kv_cache_dtype))
    assert generate(no_tier, "c", PROMPT)[0] == first
    e.close()


def test_restart_keeps_the_tier_warm_and_a_mismatch_wipes_it(ckpt, tmp_path):
    tier = tmp_path / "tier"
    e = engine(ckpt, tier)
    first, _ = generate(e, "a", PROMPT)
    fill_ram(e)
    held = len(e.disk_block_hashes())
    e.close()
    warm = engine(ckpt, tier)
    assert warm.tiers.disk.warm_blocks == held > 0
    again, cached = generate(warm, "b", PROMPT)
    assert cached >= 36 and again == first
    warm.close()
    other = engine(ckpt, tier, kv_cache_dtype="int8")
    assert other.tiers.disk.warm_blocks == 0 and "differs" in other.tiers.disk.wiped_reason
    other.close()


def test_a_pull_reads_blocks_from_the_disk_tier_too(ckpt, tmp_path):
    """A holder whose blocks went down to disk still answers a KV pull with them: a puller
    without a tier continues with the holder's own greedy output."""
    holder = engine(ckpt, tmp_path / "tier")
    first, _ = generate(holder, "a", PROMPT)
    fill_ram(holder)
    assert holder.cached_prefix_blocks(PROMPT) == 0  # RAM no longer has them
    kv = holder.export_prefix(PROMPT[:36], 0)  # what a puller asks: the blocks it can use
    assert kv.num_blocks == 9  # all from disk
    puller = Engine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4,
                                 num_kv_blocks=24))
    assert puller.import_prefix(PROMPT, 0, kv) == 9
    again, cached = generate(puller, "b", PROMPT)
    assert cached == 36 and again == first
    generate(holder, "c", PROMPT[:20])  # blocks 0-3 promoted to RAM, block 4 recomputed
    assert holder.cached_prefix_blocks(PROMPT) == 5
    mixed = holder.export_prefix(PROMPT[:36], 0)  # 5 from RAM, 4 from disk, in order
    per_block = len(kv.data) // 9
    assert mixed.num_blocks == 9 and bytes(mixed.data)[: 4 * per_block] == \
        bytes(kv.data)[: 4 * per_block] and bytes(mixed.data)[5 * per_block:] == \
        bytes(kv.data)[5 * per_block:]
