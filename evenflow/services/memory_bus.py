"""An in-process message bus with the NATS bus's interface, for unit-testing a service's message
handling without nats-server or subprocesses. Messages still go through the wire codec (encode
on publish, decode on delivery, malformed payloads dropped and counted), in order per
subscription, each subscription served by one listener task, as on the real bus.

Several `InMemoryBus` objects attached to one `InMemoryBroker` see each other's messages, as
several processes on one NATS server would. Subjects match as on NATS (`*` and `>` wildcards).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from opentelemetry.context import Context

from evenflow.proto import subjects
from evenflow.proto.messages import Message, encode
from evenflow.services.bus import Handler, NatsSecurity, deliver

log = logging.getLogger(__name__)


class InMemoryBroker:
    """Subject -> the queues of its subscriptions."""

    def __init__(self, max_payload: int = 1024 * 1024) -> None:
        self.max_payload = max_payload
        self.subscriptions: dict[str, list[asyncio.Queue[tuple[str, bytes]]]] = defaultdict(list)

    def publish_raw(self, subject: str, payload: bytes) -> None:
        """Deliver to every subscription whose subject (NATS wildcards allowed) matches."""
        for pattern, queues in self.subscriptions.items():
            if subjects.matches(pattern, subject):
                for queue in queues:
                    queue.put_nowait((subject, payload))


class InMemoryBus:
    def __init__(self, broker: InMemoryBroker, name: str = "memory") -> None:
        self.broker, self.name = broker, name
        self.dropped = 0
        self.last_reconnect_at = 0.0  # never disconnects
        self.reconnects = 0
        self._connected = False
        self._tasks: list[asyncio.Task] = []
        self._queues: list[tuple[str, asyncio.Queue[tuple[str, bytes]]]] = []

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def max_payload(self) -> int:
        return self.broker.max_payload

    async def connect(self, url: str, timeout_s: float = 5.0,
                      security: NatsSecurity | None = None) -> None:
        self._connected = True

    async def publish(self, subject: str, message: Message) -> None:
        assert self._connected, "connect first"
        self.broker.publish_raw(subject, encode(message))

    async def subscribe(self, subject: str, handler: Handler) -> None:
        assert self._connected, "connect first"
        queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        self.broker.subscriptions[subject].append(queue)
        self._queues.append((subject, queue))
        self._tasks.append(asyncio.create_task(self._listen(subject, queue, handler),
                                               name=f"listen {subject}"))

    async def _listen(self, pattern: str, queue: asyncio.Queue[tuple[str, bytes]],
                      handler: Handler) -> None:
        while True:
            subject, payload = await queue.get()
            reason = await deliver(subject, payload, Context(), handler)
            if reason is not None:
                self.dropped += 1
                log.warning("dropped a message on %s: %s", subject, reason)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for subject, queue in self._queues:
            self.broker.subscriptions[subject].remove(queue)
        self._queues.clear()
        self._connected = False
