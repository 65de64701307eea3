from evenflow.engine.core.block_manager import BlockManager
from evenflow.engine.core.sequence import Sequence
from evenflow.proto.messages import BlockRemoved, BlockStored
from evenflow.proto.sampling import SamplingParams


def seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), len(tokens), SamplingParams())


def compute_all(bm, s):
    bm.allocate_first(s, bm.prefix_hits(s), s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.commit_full_blocks(s)


def test_prefix_hit_shares_blocks_and_counts_references():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(10), "a")
    compute_all(bm, a)
    assert bm.take_events() == [BlockStored(block_hashes=a.block_hashes[:2], parent_block_hash=None,
                                            token_ids=list(range(8)), block_size=4)]
    b = seq(list(range(8)) + [99, 98, 97], "b")
    hits = bm.prefix_hits(b)
    assert hits == a.block_table[:2]
    bm.allocate_first(b, hits, b.num_tokens)
    assert b.num_cached_tokens == 8
    assert bm.ref_counts[a.block_table[0]] == 2
    assert bm.num_free_blocks == 8 - 3 - 1  # a holds 3, b adds one new block


def test_the_last_token_is_never_a_cache_hit():
    bm = BlockManager(num_blocks=8, block_size=4)
    compute_all(bm, seq(range(8), "a"))
    again = seq(range(8), "b")
    assert len(bm.prefix_hits(again)) == 1  # the second block holds the token to recompute


def test_freed_blocks_stay_cached_until_evicted_lru_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(range(8), "a")
    compute_all(bm, a)
    bm.free_sequence(a)
    bm.take_events()
    assert bm.num_free_blocks == 4
    assert len(bm.prefix_hits(seq(range(9), "x"))) == 2  # still cached after free
    # Filling the cache evicts the never-cached blocks first, then a's tail before its head.
    big = seq(range(100, 113), "big")
    bm.allocate_first(big, [], 13)
    events = bm.take_events()
    assert events == [BlockRemoved(block_hashes=[a.block_hashes[1]]),
                      BlockRemoved(block_hashes=[a.block_hashes[0]])]
    assert bm.prefix_hits(seq(range(9), "y")) == []


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    compute_all(bm, seq(range(9), "a"))
    assert bm.prefix_hits(seq(range(9), "b")) == []
    assert bm.take_events() == []
