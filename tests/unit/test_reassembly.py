"""Framed-message reassembly stays inside its memory budget, per peer and in total."""

from __future__ import annotations

from evenflow.services.reassembly import Reassembly, ReassemblyBudget

KIB = 1024


def make(peer_kib: int = 64, total_kib: int = 256, timeout_s: float = 30.0):
    now = [0.0]
    dropped: list[str] = []
    frames = Reassembly(ReassemblyBudget(peer_bytes=peer_kib * KIB, total_bytes=total_kib * KIB,
                                         timeout_s=timeout_s),
                        on_drop=dropped.append, clock=lambda: now[0])
    return frames, dropped, now


def test_a_whole_message_comes_back_in_order_whatever_the_arrival_order():
    frames, dropped, _ = make()
    assert frames.add("m 2 3 a", b"c") is None
    assert frames.add("m 0 3 a", b"a") is None
    assert frames.add("m 1 3 a", b"b") == b"abc"
    assert frames.held_bytes == 0 and dropped == []


def test_a_peer_announcing_many_parts_cannot_pass_its_budget_and_others_still_get_through():
    frames, dropped, _ = make(peer_kib=64, total_kib=256)
    for i in range(1000):  # a rogue peer: 100,000 parts announced, never finished
        frames.add(f"rogue{i} 0 100000 mallory", bytes(KIB))
        assert frames.held_by("mallory") <= 64 * KIB
    assert frames.add("good 0 2 alice", b"x" * KIB) is None
    assert frames.add("good 1 2 alice", b"y" * KIB) == b"x" * KIB + b"y" * KIB
    assert any("mallory over its reassembly budget" in r for r in dropped)


def test_the_total_budget_sheds_the_heaviest_peers_oldest_message():
    frames, dropped, now = make(peer_kib=100, total_kib=128)
    for i in range(3):
        now[0] += 1
        frames.add(f"big{i} 0 2 heavy", bytes(30 * KIB))
    frames.add("small 0 2 light", bytes(30 * KIB))
    frames.add("new 0 2 light", bytes(30 * KIB))  # 150 KiB would pass 128: shed big0
    assert frames.held_bytes <= 128 * KIB
    assert frames.held_by("heavy") == 60 * KIB and frames.held_by("light") == 60 * KIB
    assert frames.add("big0 1 2 heavy", bytes(KIB)) is None  # big0 is gone: starts anew
    assert "total reassembly budget exceeded" in dropped


def test_incomplete_messages_expire_and_free_their_bytes():
    frames, dropped, now = make(timeout_s=30)
    frames.add("m 0 2 a", bytes(KIB))
    now[0] = 31
    frames.add("n 0 2 a", bytes(KIB))
    assert frames.held_by("a") == KIB
    assert dropped == ["incomplete framed message timed out"]


def test_bad_repeated_or_foreign_frames_are_dropped_with_a_reason():
    frames, dropped, _ = make()
    assert frames.add("nonsense", b"z") is None
    assert frames.add("m 5 2 a", b"z") is None  # index out of range
    assert frames.add("m 0 200000 a", b"z") is None  # too many parts
    frames.add("m 0 2 a", b"x")
    assert frames.add("m 0 2 a", b"x") is None  # repeated: the message is dropped
    frames.add("k 0 2 a", b"x")
    assert frames.add("k 1 2 b", b"x") is None  # another sender cannot finish a's message
    assert frames.held_bytes == 0
    assert len(dropped) == 5


def test_frames_from_older_senders_without_a_name_still_reassemble():
    frames, _, _ = make()
    frames.add("m 0 2", b"a")
    assert frames.add("m 1 2", b"b") == b"ab"
