"""The gateway's SSE response: chunks go out as the body yields them, and a client that leaves
cancels the body where it waits (so the request is cancelled downstream) and gives the
admission slot back; the response itself ends normally."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from evenflow.gateway.responses import AdmittedStream, LastChunk

SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}


def run_response(body: AsyncIterator[bytes], leave_after_chunks: int | None
                 ) -> tuple[list[dict], list[str]]:
    """Serve one response to a fake client; -> (messages sent, what happened)."""
    sent: list[dict] = []
    events: list[str] = []

    async def main() -> None:
        left = asyncio.Event()

        async def receive() -> dict:
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)
            chunks = sum(1 for m in sent if m.get("more_body"))
            if leave_after_chunks is not None and chunks >= leave_after_chunks:
                left.set()

        response = AdmittedStream(body, lambda: events.append("released"))
        await asyncio.wait_for(response(SCOPE, receive, send), 5)
        events.append("returned")

    asyncio.run(main())
    return sent, events


def test_streams_every_chunk_then_ends_the_body() -> None:
    async def body() -> AsyncIterator[bytes]:
        for i in range(3):
            yield f"data: {i}\n\n".encode()

    sent, events = run_response(body(), None)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]
    assert [m["body"] for m in sent[1:]] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""]
    assert sent[-1]["more_body"] is False
    assert events == ["released", "returned"]


def test_the_last_chunk_goes_out_with_the_end_of_the_body() -> None:
    """The final events and [DONE] end the body in the same message: one socket write."""
    async def body() -> AsyncIterator[bytes]:
        yield b"data: 0\n\n"
        yield LastChunk(b"data: 1\n\ndata: [DONE]\n\n")

    sent, events = run_response(body(), None)
    assert [(m["body"], m["more_body"]) for m in sent[1:]] == [
        (b"data: 0\n\n", True), (b"data: 1\n\ndata: [DONE]\n\n", False)]
    assert events == ["released", "returned"]


def test_a_client_that_leaves_cancels_the_waiting_body_and_frees_the_slot() -> None:
    body_events: list[str] = []

    async def body() -> AsyncIterator[bytes]:
        try:
            yield b"data: 0\n\n"
            yield b"data: 1\n\n"
            await asyncio.sleep(3600)  # waiting for a token that will not come
            yield b"data: never\n\n"
        except asyncio.CancelledError:
            body_events.append("cancelled")  # where client.generate cancels downstream
            raise

    sent, events = run_response(body(), leave_after_chunks=2)
    assert body_events == ["cancelled"]
    assert events == ["released", "returned"]  # ended normally, slot given back
    assert not any(m.get("body") == b"data: never\n\n" for m in sent)
