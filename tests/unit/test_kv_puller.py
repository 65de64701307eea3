"""The asking side of a KV pull (services/kv_pull.py) hands back K/V only when the worker it
asked sends whole, ordered chunks carrying the pull's nonce; anything else (a refusal, a
forged reply, broken chunks, silence) gives None within the pull's timeout, so the prompt is
recomputed. A forger naming the asked holder, but without the nonce only that holder learned,
lands not a single block."""

from __future__ import annotations

import asyncio

from evenflow.proto import subjects
from evenflow.proto.messages import KVBlockChunk, KVPullDone, KVPullRequest

SHAPE = (2, 4)  # one block's shape: 8 bytes of uint8


def puller(sent: list, timeout_s: float = 2.0):
    from evenflow.services.kv_pull import KVPuller

    return KVPuller(lambda subject, message, ctx: sent.append((subject, message)), "p0",
                    lambda: SHAPE, timeout_s)


async def pull_with(replies, timeout_s: float = 2.0):
    """Start a pull of blocks 3.. from d0, answer it with `replies(request)`, return its
    result and what the puller sent."""
    sent: list = []
    p = puller(sent, timeout_s)
    task = asyncio.create_task(p.pull("r1", "d0", list(range(64)), 3))
    await asyncio.sleep(0)
    [(subject, request)] = sent
    assert subject == subjects.kv_pull("d0") and isinstance(request, KVPullRequest)
    assert request.first_block == 3 and request.reply_subject == subjects.kv_pulled("p0")
    assert len(request.nonce) == 32  # 128 random bits, fresh per pull
    for message in replies(request):
        p.on_message(message, None)
    return await task


def chunk(seq: int, first: int, blocks: int, nonce: str, fill: int = 0) -> KVBlockChunk:
    return KVBlockChunk(request_id="r1", seq=seq, first_block=first, num_blocks=blocks,
                        data=bytes([fill] * (8 * blocks)), nonce=nonce)


def done(nonce: str, worker: str = "d0", chunks: int = 2, blocks: int = 3,
         error: str = "") -> KVPullDone:
    return KVPullDone(request_id="r1", num_chunks=chunks, num_blocks=blocks, first_block=3,
                      dtype="uint8", worker_id=worker, error=error, nonce=nonce)


def test_whole_ordered_chunks_from_the_holder_are_the_kv():
    kv = asyncio.run(pull_with(lambda r: [chunk(0, 0, 2, r.nonce), chunk(1, 2, 1, r.nonce),
                                          done(r.nonce)]))
    assert kv is not None and kv.num_blocks == 3 and kv.shape == (3, *SHAPE)


def test_a_refusal_or_an_empty_answer_is_none_at_once():
    assert asyncio.run(pull_with(lambda r: [done(r.nonce, chunks=0, blocks=0,
                                                 error="no")])) is None
    assert asyncio.run(pull_with(lambda r: [done(r.nonce, chunks=0, blocks=0)])) is None


def test_broken_chunks_are_none():
    assert asyncio.run(pull_with(lambda r: [chunk(1, 2, 1, r.nonce), chunk(0, 0, 2, r.nonce),
                                            done(r.nonce)])) is None
    assert asyncio.run(pull_with(lambda r: [chunk(0, 0, 2, r.nonce), done(r.nonce)])) is None


def test_a_forged_reply_without_the_nonce_is_ignored_and_the_pull_times_out():
    """Another worker's credentials may publish to p0's reply subject and may name d0, but
    without the nonce its blocks never reach the pull."""
    from evenflow.services.metrics import KV_PULL_REPLIES_DROPPED

    before = KV_PULL_REPLIES_DROPPED.labels(reason="bad_nonce")._value.get()

    async def run():
        started = asyncio.get_running_loop().time()
        kv = await pull_with(lambda r: [chunk(0, 0, 2, "guess"), chunk(1, 2, 1, ""),
                                        done("0" * 32)], timeout_s=0.2)
        return kv, asyncio.get_running_loop().time() - started

    kv, took = asyncio.run(run())
    assert kv is None and took < 1.0
    assert KV_PULL_REPLIES_DROPPED.labels(reason="bad_nonce")._value.get() - before == 3


def test_forged_chunks_before_the_holders_do_not_mix_into_its_answer():
    kv = asyncio.run(pull_with(lambda r: [
        chunk(0, 0, 2, "forged", fill=255), chunk(0, 0, 2, r.nonce), chunk(1, 2, 1, r.nonce),
        chunk(1, 2, 1, "forged", fill=255), done(r.nonce)]))
    assert kv is not None and kv.num_blocks == 3
    assert 255 not in bytes(kv.data)


def test_a_holder_answering_elsewhere_is_not_served():
    from evenflow.services.kv_pull import PullServer

    submitted: list = []
    server = PullServer(lambda *a: None, submitted.append, "d0", 4096)
    server.on_request(KVPullRequest(request_id="r", prompt_token_ids=[1, 2], first_block=0,
                                    reply_subject="evenflow.gateway.x"), None)
    server.on_request(KVPullRequest(request_id="r", prompt_token_ids=[1, 2], first_block=0,
                                    reply_subject=subjects.kv_pulled("p0")), None)
    assert len(submitted) == 1
