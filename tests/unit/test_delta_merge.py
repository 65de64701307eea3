"""A slow stream's waiting deltas join into one (fewer SSE events, same tokens), and only
when they continue each other exactly."""

from __future__ import annotations

import asyncio

from evenflow.gateway.replies import DeltaQueue
from evenflow.proto.messages import ErrorMessage, TokenDelta


def delta(first: int, ids: list[int], finish: str | None = None, rid: str = "r",
          logprobs: bool = False) -> TokenDelta:
    return TokenDelta(request_id=rid, token_ids=ids, first_index=first, finish_reason=finish,
                      logprobs=[-0.5] * len(ids) if logprobs else [],
                      top_logprob_ids=[[i] for i in ids] if logprobs else [],
                      top_logprobs=[[-0.5] for _ in ids] if logprobs else [])


def drain(items: list) -> list:
    async def run() -> list:
        queue = DeltaQueue()
        for item in items:
            queue.put_nowait(item)
        return [queue.get_nowait() for _ in range(queue.qsize())]

    return asyncio.run(run())


def test_waiting_contiguous_deltas_join_until_one_finishes():
    out = drain([delta(0, [5], logprobs=True), delta(1, [6, 7], logprobs=True),
                 delta(3, [8], "length", logprobs=True), delta(4, [9])])
    assert [d.token_ids for d in out] == [[5, 6, 7, 8], [9]]
    assert out[0].finish_reason == "length" and out[0].first_index == 0
    assert out[0].logprobs == [-0.5] * 4 and out[0].top_logprob_ids == [[5], [6], [7], [8]]


def test_gaps_other_attempts_and_errors_stay_apart():
    error = ErrorMessage(request_id="r", code="worker_error", description="x", retryable=True)
    out = drain([delta(0, [5]), delta(2, [7]), delta(3, [8], rid="r.1"), error, delta(4, [9])])
    assert [getattr(d, "token_ids", None) for d in out] == [[5], [7], [8], None, [9]]
