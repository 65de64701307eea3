"""The load generator's HTTP client reads what OpenAI-compatible servers stream: chunked SSE
(events split across chunks, CRLF or LF line ends), sized error bodies, kept-alive connections
and connections the server closed between requests."""

from __future__ import annotations

import asyncio

import pytest

from evenflow.bench.sse_client import HTTPStatusError, SSEClient


class TinyServer:
    """An HTTP/1.1 server on a free port answering each request with the next scripted reply
    (raw bytes); `close_after` replies it closes the connection."""

    def __init__(self, replies: list[bytes], close_after: int = 0) -> None:
        self.replies, self.close_after = replies, close_after
        self.connections = 0
        self.requests: list[bytes] = []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while self.replies:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                self.requests.append(await reader.readexactly(length))
                writer.write(self.replies.pop(0))
                await writer.drain()
                served += 1
                if self.close_after and served >= self.close_after:
                    break
        except asyncio.IncompleteReadError:
            pass
        writer.close()


def chunked(*pieces: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    return (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + body)


async def collect(client: SSEClient) -> list[bytes]:
    async with client.stream("/v1/completions", {"prompt": [1, 2]}) as events:
        return [data async for data in events]


def test_events_split_across_chunks_and_crlf_line_ends_arrive_whole() -> None:
    reply = chunked(b'data: {"a": 1}\n\ndata: {"b"', b': 2}\r\n\r\ndata: [DO', b"NE]\n\n")

    async def main() -> list[bytes]:
        async with TinyServer([reply]) as url, SSEClient(url) as client:
            return await collect(client)

    assert asyncio.run(main()) == [b'{"a": 1}', b'{"b": 2}', b"[DONE]"]


def test_a_refusal_raises_with_its_status_and_body() -> None:
    body = b'{"error": {"message": "max_tokens is too large"}}'
    reply = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
             b"content-length: %d\r\n\r\n%s" % (len(body), body))

    async def main() -> None:
        async with TinyServer([reply]) as url, SSEClient(url) as client:
            await collect(client)

    with pytest.raises(HTTPStatusError, match="HTTP 400.*max_tokens is too large"):
        asyncio.run(main())


def test_connections_are_kept_alive_and_a_closed_one_is_replaced() -> None:
    replies = [chunked(b"data: %d\n\n" % i) for i in range(4)]

    async def main(server: TinyServer) -> list[list[bytes]]:
        async with server as url, SSEClient(url) as client:
            return [await collect(client) for _ in range(4)]

    kept = TinyServer(list(replies))
    assert asyncio.run(main(kept)) == [[b"0"], [b"1"], [b"2"], [b"3"]]
    assert kept.connections == 1
    assert kept.requests[0] == b'{"prompt":[1,2]}'

    closing = TinyServer(list(replies), close_after=1)  # the server drops every connection
    assert asyncio.run(main(closing)) == [[b"0"], [b"1"], [b"2"], [b"3"]]
    assert closing.connections == 4
