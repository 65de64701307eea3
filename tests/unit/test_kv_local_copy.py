"""A gateway's own copy of the KV index (kv_index/local_copy.py): it answers the same prefix
match as the Redis index from the event stream, knows when it is behind (no snapshot yet, a
gap, a restarted worker) and asks for the snapshots it needs."""

from __future__ import annotations

from evenflow.kv_index.local_copy import RESYNC_EVERY_S, LocalIndex
from evenflow.proto.messages import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvents,
    KVSnapshot,
)


def events(worker: str, seq: int, *evs, epoch: str = "e1") -> KVEvents:
    return KVEvents(worker_id=worker, role="decode", epoch=epoch, seq=seq, events=list(evs))


def stored(*hashes: int) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[],
                       block_size=16)


def snapshot(worker: str, seq: int, hashes: list[int], epoch: str = "e1") -> KVSnapshot:
    return KVSnapshot(worker_id=worker, role="decode", epoch=epoch, seq=seq,
                      block_hashes=hashes)


def test_a_synced_copy_matches_leading_blocks_per_worker():
    index = LocalIndex()
    live = {"d0": "e1", "p0": "e1"}
    assert index.behind(live) == ["d0", "p0"]  # nothing seen yet: ask Redis
    index.apply(snapshot("d0", 0, [1, 2]))
    index.apply(snapshot("p0", 4, []))
    index.apply(events("d0", 1, stored(3)))
    index.apply(events("p0", 5, stored(1)))
    assert index.behind(live) == []
    assert index.match([1, 2, 3, 4], live) == {"d0": 3, "p0": 1}
    assert index.match([9, 1], live) == {}  # a prefix, not any block
    assert index.match([1, 2], {"d0": "e1"}) == {"d0": 2}  # dead workers do not count
    index.apply(events("d0", 2, BlockRemoved(block_hashes=[2], medium=None)))
    assert index.match([1, 2, 3], live) == {"d0": 1, "p0": 1}
    index.apply(events("d0", 3, AllBlocksCleared()))
    assert index.match([1], live) == {"p0": 1}


def test_a_gap_or_a_restart_puts_the_copy_behind_until_a_snapshot():
    index = LocalIndex()
    live = {"d0": "e1"}
    index.apply(snapshot("d0", 0, [1]))
    index.apply(events("d0", 2, stored(2)))  # seq 1 was missed
    assert index.behind(live) == ["d0"]
    index.apply(events("d0", 3, stored(3)))  # ignored while behind
    index.apply(snapshot("d0", 3, [1, 2, 3]))
    assert index.behind(live) == [] and index.match([1, 2, 3], live) == {"d0": 3}
    # the worker restarted (new epoch): its old blocks are gone, it is behind again
    restarted = {"d0": "e2"}
    assert index.behind(restarted) == ["d0"]
    index.apply(snapshot("d0", 0, [7], epoch="e2"))
    assert index.match([1], restarted) == {} and index.match([7], restarted) == {"d0": 1}


def test_snapshots_are_asked_for_at_most_every_few_seconds():
    index = LocalIndex()
    live = {"d0": "e1", "d1": "e1"}
    assert index.to_resync(live, now=100.0) == ["d0", "d1"]
    assert index.to_resync(live, now=100.5) == []
    assert index.to_resync(live, now=100.0 + RESYNC_EVERY_S) == ["d0", "d1"]
    index.apply(snapshot("d0", 0, []))
    assert index.to_resync(live, now=200.0) == ["d1"]
    index.forget("d1")
    assert "d1" not in index.workers


def test_this_gateways_predictions_give_each_worker_its_leading_run_of_blocks():
    """A worker predicted to hold blocks counts only up to the first block it lacks (or whose
    prediction expired), as the index's own match does."""
    import time

    from evenflow.kv_index.client import KVIndexClient

    client = KVIndexClient.__new__(KVIndexClient)  # (no Redis: predictions are local)
    later, gone = time.monotonic() + 60, time.monotonic() - 1
    client._predicted = {1: {"a": later, "b": later, "c": gone}, 2: {"a": later, "b": later},
                         3: {"a": later}, 4: {"a": later, "b": later}}
    assert client._local_prefix([1, 2, 3, 4]) == {"a": 4, "b": 2}
    assert client._local_prefix([1, 2, 9, 4]) == {"a": 2, "b": 2}
    assert client._local_prefix([2, 3]) == {"a": 2, "b": 1}
    assert client._local_prefix([7, 1]) == {} and client._local_prefix([]) == {}
    assert client.with_predictions({"b": 3, "d": 1}, [1, 2, 3, 4]) == {"b": 3, "d": 1, "a": 4}


def test_disk_tier_blocks_count_at_their_credit_and_only_beyond_the_ram_run():
    """A worker's disk tier (events with medium "disk", the snapshot's disk part) extends its
    RAM run at disk_credit a block; without credit the copy answers as Redis does (RAM)."""
    index = LocalIndex()
    live = {"d0": "e1", "d1": "e1"}
    index.apply(KVSnapshot(worker_id="d0", role="decode", epoch="e1", seq=0,
                           block_hashes=[1, 2], disk_block_hashes=[3]))
    index.apply(snapshot("d1", 0, []))
    index.apply(events("d0", 1, BlockStored(block_hashes=[4], parent_block_hash=3, token_ids=[],
                                            block_size=16, medium="disk")))
    index.apply(events("d1", 1, BlockStored(block_hashes=[1, 2, 3], parent_block_hash=None,
                                            token_ids=[], block_size=16, medium="disk")))
    assert index.match([1, 2, 3, 4, 5], live) == {"d0": 2}
    assert index.match([1, 2, 3, 4, 5], live, disk_credit=0.5) == {"d0": 3.0, "d1": 1.5}
    index.apply(events("d0", 2, BlockRemoved(block_hashes=[3], medium="disk")))
    assert index.match([1, 2, 3, 4], live, disk_credit=0.5)["d0"] == 2  # the run ends at 3
    index.apply(events("d0", 3, AllBlocksCleared()))
    assert "d0" not in index.match([1, 2, 3, 4], live, disk_credit=0.5)
