"""The KV hand-off on its own: split into whole-block chunks, reassemble, and refuse anything
that is not exactly the blocks that were sent."""

from __future__ import annotations

import pytest

from evenflow.proto.kv_handoff import Assembler, KVHandoffError, KVPayload, split

BLOCK_SHAPE = (2, 2, 4, 1, 8)  # layers, K/V, block size, kv heads, head dim
BLOCK_BYTES = 2 * 2 * 4 * 1 * 8 * 2  # bfloat16


def payload(num_blocks: int) -> KVPayload:
    data = bytes(i % 251 for i in range(num_blocks * BLOCK_BYTES))
    return KVPayload(memoryview(data), "bfloat16", num_blocks, BLOCK_SHAPE)


def reassemble(chunks, num_blocks=5) -> KVPayload:
    assembler = Assembler()
    for c in chunks:
        assembler.add(c.seq, c.first_block, c.num_blocks, bytes(c.data))
    return assembler.finish(len(chunks), num_blocks, "bfloat16", BLOCK_SHAPE)


def test_chunks_carry_whole_blocks_and_reassemble_byte_identical():
    sent = payload(5)
    chunks = split(sent, max_bytes=2 * BLOCK_BYTES + 7)
    assert [(c.seq, c.first_block, c.num_blocks) for c in chunks] == [
        (0, 0, 2), (1, 2, 2), (2, 4, 1)]
    got = reassemble(chunks)
    assert bytes(got.data) == bytes(sent.data) and got.shape == (5, *BLOCK_SHAPE)


def test_a_chunk_smaller_than_one_block_still_carries_one_block():
    assert [c.num_blocks for c in split(payload(3), max_bytes=10)] == [1, 1, 1]


def test_duplicated_chunk_fails_the_transfer():
    chunks = split(payload(5), max_bytes=BLOCK_BYTES)
    with pytest.raises(KVHandoffError, match="duplicated"):
        reassemble([chunks[0], chunks[1], chunks[1], *chunks[2:]])


def test_missing_chunk_fails_the_transfer():
    chunks = split(payload(5), max_bytes=BLOCK_BYTES)
    with pytest.raises(KVHandoffError, match="missing"):
        reassemble([chunks[0], *chunks[2:]])
    with pytest.raises(KVHandoffError, match="4 of 5"):  # the last one never came
        assembled(chunks[:4]).finish(5, 5, "bfloat16", BLOCK_SHAPE)


def assembled(chunks) -> Assembler:
    assembler = Assembler()
    for c in chunks:
        assembler.add(c.seq, c.first_block, c.num_blocks, bytes(c.data))
    return assembler


def test_byte_count_must_match_blocks_and_dtype():
    chunks = split(payload(5), max_bytes=BLOCK_BYTES)
    with pytest.raises(KVHandoffError, match="blocks of"):  # float32 blocks are twice as big
        assembled(chunks).finish(5, 5, "float32", BLOCK_SHAPE)
    with pytest.raises(KVHandoffError, match="dtype"):
        assembled(chunks).finish(5, 5, "int64", BLOCK_SHAPE)


def test_the_mock_engine_layout_has_no_bytes():
    empty = KVPayload(b"", "uint8", 3, (0,))
    chunks = split(empty, max_bytes=1024)
    assert len(chunks) == 1 and chunks[0].num_blocks == 3
    assert assembled(chunks).finish(1, 3, "uint8", (0,)).num_blocks == 3
