"""The KV cache's disk tier: blocks evicted from RAM go to disk and come back on a prefix hit
with the same greedy output as when they were computed; a restarted engine keeps the tier
warm, a different model or KV dtype wipes it; the tier's events name their medium."""

from __future__ import annotations

import pytest
from checkpoints import generate_one, make_checkpoint, run_to_end
from prometheus_client import REGISTRY

from evenflow import SamplingParams
from evenflow.engine.serving.engine import Engine, EngineConfig
from evenflow.kv_index.local_copy import LocalIndex
from evenflow.proto.hashing import chain_hashes
from evenflow.proto.messages import BlockStored, KVEvents, KVSnapshot
from evenflow.services.metrics import export_kv_disk_counts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe")
    make_checkpoint("qwen3_moe", path)
    return path


def engine(ckpt, tier, **more):
    settings = {**dict(model=str(ckpt), dtype="float32", block_size=4, num_kv_blocks=24,
                       kv_disk_dir=str(tier), kv_disk_gb=0.01), **more}
    return Engine(EngineConfig(**settings), collect_kv_events=True)


def generate(e, rid, prompt):
    return generate_one(e, rid, prompt, GREEDY)


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
    events = e.prefix.take_kv_events()
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
    held = len(e.prefix.disk_block_hashes())
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
    assert holder.prefix.cached_prefix_blocks(PROMPT) == 0  # RAM no longer has them
    kv = holder.prefix.export_prefix(PROMPT[:36], 0)  # what a puller asks: the blocks it can use
    assert kv.num_blocks == 9  # all from disk
    puller = Engine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4,
                                 num_kv_blocks=24))
    assert puller.prefix.import_prefix(PROMPT, 0, kv) == 9
    again, cached = generate(puller, "b", PROMPT)
    assert cached == 36 and again == first
    generate(holder, "c", PROMPT[:20])  # blocks 0-3 promoted to RAM, block 4 recomputed
    assert holder.prefix.cached_prefix_blocks(PROMPT) == 5
    mixed = holder.prefix.export_prefix(PROMPT[:36], 0)  # 5 from RAM, 4 from disk, in order
    per_block = len(kv.data) // 9
    assert mixed.num_blocks == 9 and bytes(mixed.data)[: 4 * per_block] == \
        bytes(kv.data)[: 4 * per_block] and bytes(mixed.data)[5 * per_block:] == \
        bytes(kv.data)[5 * per_block:]


def test_a_block_evicted_in_the_same_schedule_is_still_a_hit(ckpt, tmp_path):
    """The user's misses: a repeated prompt whose cached blocks another request's admission
    evicts in the same schedule (their copy to disk not made yet) was computed again, 0 tokens
    cached, although the KV index (fed by the engine's own events) still named every block.
    Each evicted block now comes back from the copy being written."""
    e = engine(ckpt, tmp_path / "tier", num_kv_blocks=40)
    first, _ = generate(e, "a", PROMPT)  # 13 blocks, freed before c's
    generate(e, "c", list(range(100, 140)))  # 13 more: the free list ends with them
    index = LocalIndex()
    index.apply(KVSnapshot(worker_id="w", role="prefill", epoch="e", seq=1, block_hashes=[]))
    index.apply(KVEvents(worker_id="w", role="prefill", epoch="e", seq=2,
                         events=e.prefix.take_kv_events()))
    hashes = chain_hashes(PROMPT, 4, e.blocks.salt)
    assert index.match(hashes, {"w": "e"}, 0.9) == {"w": 10}  # routed as a hit
    # x's admission takes the 14 unused blocks and all of a's (oldest first); b comes next
    e.add_request("x", list(range(150, 250)) + [3] * 8, GREEDY)
    e.add_request("b", PROMPT, GREEDY)
    out, cached = run_to_end(e)
    assert cached["b"] == 36 and out["b"] == first
    assert e.prefix.disk_counts.promotions >= 9
    e.close()


def test_blocks_promoted_while_the_tier_makes_room_are_read_first(ckpt, tmp_path):
    """A full disk tier: the copies a promotion's own RAM evictions make push the promoted
    blocks out of the tier in the same step; they are read before that, not lost (the step
    failed with a KeyError), and the tier's events leave the index with what it holds."""
    probe = engine(ckpt, tmp_path / "probe")
    slot = probe.tiers.disk.slot_bytes
    probe.close()
    e = engine(ckpt, tmp_path / "tier", kv_disk_gb=12.5 * slot / 2**30)
    assert e.tiers.disk.capacity == 12
    first, _ = generate(e, "a", PROMPT)
    generate(e, "x", list(range(100, 180)))  # a's blocks but its first go down to disk
    index = LocalIndex()
    index.apply(KVSnapshot(worker_id="w", role="prefill", epoch="e", seq=1,
                           block_hashes=e.prefix.cached_block_hashes(),
                           disk_block_hashes=e.prefix.disk_block_hashes()))
    again, cached = generate(e, "b", PROMPT)
    assert cached == 36 and again == first
    index.apply(KVEvents(worker_id="w", role="prefill", epoch="e", seq=2,
                         events=e.prefix.take_kv_events()))
    assert index.workers["w"].disk == set(e.prefix.disk_block_hashes())
    assert index.workers["w"].blocks == set(e.prefix.cached_block_hashes())
    e.close()


def test_a_request_waits_for_room_to_promote_and_then_gets_every_block(ckpt, tmp_path):
    """No free RAM block to promote into (another request holds them) is a wait, not a
    recompute: counted once as a no_room miss, then the prompt is served from disk."""
    e = engine(ckpt, tmp_path / "tier")
    first, _ = generate(e, "a", PROMPT)
    generate(e, "y", list(range(100, 180)))  # 23 of 24 blocks: a's go to disk but its first
    e.add_request("x", list(range(176, 256)), GREEDY)  # 20 blocks now (a's first among them)
    e.add_request("b", PROMPT, GREEDY)  # 4 blocks left to promote into: b waits for x
    out, cached = run_to_end(e)
    assert cached["b"] == 36 and out["b"] == first
    assert e.prefix.disk_counts.misses == {"evicted": 0, "no_room": 1}
    e.close()


def test_the_disk_tier_counts_reach_the_worker_metrics(ckpt, tmp_path):
    """Writes, hits, promotions, the tier's own evictions and a miss on a block it dropped,
    as the worker exports them (services/metrics.py, on its heartbeat)."""
    probe = engine(ckpt, tmp_path / "probe")
    slot = probe.tiers.disk.slot_bytes
    probe.close()
    e = engine(ckpt, tmp_path / "tier", kv_disk_gb=12.5 * slot / 2**30)  # 12 blocks
    no_tier = Engine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4,
                                  num_kv_blocks=24))
    assert no_tier.prefix.disk_counts is None
    counts = e.prefix.disk_counts
    generate(e, "a", PROMPT)
    generate(e, "x", list(range(100, 180)))  # a's blocks but its first go down to disk
    assert generate(e, "b", PROMPT)[1] == 36  # and come back
    assert counts.hits == counts.promotions == 8 and counts.writes >= 11
    fill_ram(e)  # a's blocks down to disk again, then out of it (12 blocks hold little)
    assert generate(e, "c", PROMPT)[1] == 0
    assert counts.misses == {"evicted": 1, "no_room": 0} and counts.evictions > 0

    def sample(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    names = {"hits": "evenflow_kv_disk_hits_total",
             "promotions": "evenflow_kv_disk_promotions_total",
             "writes": "evenflow_kv_disk_writes_total",
             "evictions": "evenflow_kv_disk_evictions_total"}
    before = {key: sample(name) for key, name in names.items()}
    missed = sample("evenflow_kv_disk_misses_total", reason="evicted")
    seen: dict[str, int] = {}
    export_kv_disk_counts(counts, seen)
    export_kv_disk_counts(counts, seen)  # nothing new: nothing added
    for key, name in names.items():
        assert sample(name) - before[key] == getattr(counts, key), key
    assert sample("evenflow_kv_disk_misses_total", reason="evicted") - missed == 1
    e.close()
