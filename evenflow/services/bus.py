"""The NATS bus: typed publish and subscribe over proto messages.

The bus owns the connection (reconnecting, short ping interval), encodes and decodes messages,
injects the current trace context into NATS headers on publish and hands the extracted context to
handlers. Each subscription has one listener task; a payload that does not decode is dropped and
counted, and the listener keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from opentelemetry.context import Context

from evenflow.proto.messages import DecodeError, Message, decode, encode
from evenflow.services.metrics import MESSAGES_DROPPED
from evenflow.services.tracing import extract_context, inject_headers

log = logging.getLogger(__name__)

Handler = Callable[[Message, Context], Awaitable[None] | None]


class Bus:
    def __init__(self, name: str) -> None:
        self.name = name
        self.nc: NATS | None = None
        self.dropped = 0  # malformed or unknown messages received
        self._tasks: list[asyncio.Task] = []
        self._subs: list = []

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    @property
    def max_payload(self) -> int:
        assert self.nc is not None
        return self.nc.max_payload

    async def connect(self, url: str, timeout_s: float = 5.0) -> None:
        self.nc = await nats.connect(
            url, name=self.name, connect_timeout=timeout_s, reconnect_time_wait=0.25,
            max_reconnect_attempts=-1, ping_interval=2, max_outstanding_pings=3,
            allow_reconnect=True)

    async def publish(self, subject: str, message: Message) -> None:
        assert self.nc is not None, "connect first"
        await self.nc.publish(subject, encode(message), headers=inject_headers() or None)

    async def subscribe(self, subject: str, handler: Handler) -> None:
        """Route every message on `subject` to `handler(message, trace_context)`, in order."""
        assert self.nc is not None, "connect first"
        sub = await self.nc.subscribe(subject, pending_msgs_limit=1_000_000,
                                      pending_bytes_limit=2**30)
        self._subs.append(sub)
        self._tasks.append(asyncio.create_task(self._listen(subject, sub, handler),
                                               name=f"listen {subject}"))

    async def _listen(self, subject: str, sub, handler: Handler) -> None:
        async for raw in sub.messages:
            await self._dispatch(subject, raw, handler)

    async def _dispatch(self, subject: str, raw: Msg, handler: Handler) -> None:
        message = decode(raw.data)
        if isinstance(message, DecodeError):
            self.dropped += 1
            MESSAGES_DROPPED.labels(service=self.name).inc()
            log.warning("dropped a message on %s: %s", subject, message.reason)
            return
        try:
            result = handler(message, extract_context(raw.headers))
            if asyncio.iscoroutine(result):
                await result
        except Exception:  # a handler bug must not stop the listener
            log.exception("handler for %s failed on %s", subject, type(message).__name__)

    async def close(self) -> None:
        """Drain: finish delivering what arrived, then close the connection."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.nc is not None and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), timeout=2)
            except Exception:  # already gone: nothing left to drain
                await self.nc.close()
