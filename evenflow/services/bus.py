"""The NATS bus: typed publish and subscribe over proto messages.

The bus owns the connection (reconnecting, short ping interval), encodes and decodes messages,
injects the current trace context into NATS headers on publish and hands the extracted context to
handlers. Each subscription has one listener task; a payload that does not decode is dropped and
counted, and the listener keeps serving. A message larger than the server's max_payload travels
as numbered frames (header `Evenflow-Frame: <id> <index> <count>`) and is reassembled before
decoding under a memory budget per peer and in total (`services/reassembly.py`).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from opentelemetry.context import Context

from evenflow.proto import subjects
from evenflow.proto.messages import Message, WireError, WorkerHeartbeat, decode, encode
from evenflow.services.metrics import MESSAGES_DROPPED
from evenflow.services.reassembly import Reassembly, ReassemblyBudget
from evenflow.services.tracing import extract_context, inject_headers

log = logging.getLogger(__name__)

# A service NATS refuses to authenticate exits with this code (EX_CONFIG): a restart would
# not help, and the launcher stops the mesh instead of respawning it.
EXIT_NATS_AUTH = 78
_AUTH_ERRORS = ("authorization violation", "authentication", "user authentication expired")


class NatsAuthError(ConnectionError):
    """The NATS server refused this service's credentials (a wrong password, an unknown
    user, a revoked token): retrying would not help."""


def is_auth_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(marker in text for marker in _AUTH_ERRORS)

Handler = Callable[[Message, Context], Awaitable[None] | None]


async def deliver(subject: str, payload: bytes, context: Context,
                  handler: Handler) -> str | None:
    """Decode one payload and hand it to `handler`; why it was dropped if it did not decode. A
    handler's exception is logged, never raised: it must not stop the listener."""
    message = decode(payload)
    if isinstance(message, WireError):
        return message.reason
    if getattr(message, "reply_subject", None) == "":  # nowhere to answer: nothing to do
        return f"{type(message).__name__} with an empty reply subject"
    if isinstance(message, WorkerHeartbeat) and subject != subjects.heartbeat(
            message.role, message.worker_id):
        # Permissions let a service heartbeat on its own subject only; a heartbeat naming
        # someone else is a forgery (or a bug) and must not steer routing.
        return f"heartbeat of {message.role}/{message.worker_id} on {subject}"
    try:
        result = handler(message, context)
        if asyncio.iscoroutine(result):
            await result
    except Exception:
        log.exception("handler for %s failed on %s", subject, type(message).__name__)
    return None


def drop_kind(reason: str) -> str:
    """A dropped message's reason (free text, for the log) as a metric label: empty_reply,
    forged_heartbeat, reassembly_budget, reassembly_timeout, bad_frame or malformed."""
    for marker, kind in (("empty reply subject", "empty_reply"),
                         ("heartbeat of", "forged_heartbeat"), ("budget", "reassembly_budget"),
                         ("timed out", "reassembly_timeout"), ("frame", "bad_frame")):
        if marker in reason:
            return kind
    return "malformed"


def unreachable_reason(exc: BaseException, bus: object) -> str:
    """Why a first connect failed, in words: the attempt's own error, else what nats-py's
    error callback last said (the attempt itself only timed out), else the timeout."""
    for candidate in (exc, getattr(bus, "last_connect_error", None)):
        if candidate is not None and str(candidate):
            return f"{type(candidate).__name__}: {candidate}"
    return f"no answer ({type(exc).__name__})"


@dataclass(frozen=True)
class NatsSecurity:
    """How a service authenticates to NATS: a credentials file (services/nats_auth.py) and,
    optionally, TLS (CA to verify the server; a client certificate and key)."""

    credentials_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def connect_kwargs(self) -> dict[str, Any]:
        from evenflow.services.nats_auth import read_credentials

        kwargs: dict[str, Any] = {}
        if self.credentials_file:
            kwargs["user"], kwargs["password"] = read_credentials(self.credentials_file)
        if self.tls_ca or self.tls_cert:
            context = ssl.create_default_context(cafile=self.tls_ca)
            if self.tls_cert:
                context.load_cert_chain(self.tls_cert, self.tls_key)
            kwargs["tls"] = context
        return kwargs


class MessageBus(Protocol):
    """What services use of a bus: `Bus` (NATS) and services/memory_bus.py's InMemoryBus."""

    name: str
    dropped: int
    last_reconnect_at: float
    reconnects: int  # times the connection came back (heartbeats carry it)

    @property
    def connected(self) -> bool: ...
    @property
    def max_payload(self) -> int: ...
    async def connect(self, url: str, timeout_s: float = 5.0,
                      security: NatsSecurity | None = None) -> None: ...
    async def publish(self, subject: str, message: Message) -> None: ...
    async def subscribe(self, subject: str, handler: Handler) -> None: ...
    async def close(self) -> None: ...


FRAME_HEADER = "Evenflow-Frame"


class Bus:
    def __init__(self, name: str, budget: ReassemblyBudget | None = None) -> None:
        self.name = name
        self.budget = budget or ReassemblyBudget()
        # one for every subscription: a peer's budget is per receiving process
        self.frames = Reassembly(self.budget, on_drop=self._count_dropped)
        self._expiry: asyncio.Task | None = None
        self.nc: NATS | None = None
        self.dropped = 0  # malformed or unknown messages received
        self._last_error_log = 0.0
        self._closing = False  # close() began: losing the connection is expected
        # When the connection last came back (monotonic): what was published around an outage
        # may be lost (a server restart forgets subscriptions until clients renew them).
        self.last_reconnect_at = 0.0
        self.reconnects = 0
        # why the last connection attempt failed (nats-py's error callback says it; the
        # attempt itself only times out)
        self.last_connect_error: Exception | None = None
        self._subs: list = []

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    @property
    def max_payload(self) -> int:
        assert self.nc is not None
        return self.nc.max_payload

    async def connect(self, url: str, timeout_s: float = 5.0,
                      security: NatsSecurity | None = None) -> None:
        """Connect (and keep reconnecting). With `security`, as its user and over TLS when it
        names certificates; never anonymously then. Raises NatsAuthError at once when the
        server refuses the credentials (nats-py alone would retry them forever)."""
        kwargs: dict[str, Any] = {}
        if security is not None:
            kwargs = security.connect_kwargs()
        # several servers (a NATS cluster, one per host): "nats://a:4222,nats://b:4222";
        # taken in the order given (list this host's own first), failing over to the next:
        # a service that picked another host's server at random would lose the bus, and every
        # worker's heartbeats with it, whenever that host's link did (bench chaos found it)
        servers = [u.strip() for u in url.split(",") if u.strip()]
        refused: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        reasons: list[Exception] = []
        nc = NATS()

        async def on_error(exc: Exception) -> None:
            if not nc.is_connected:
                self.last_connect_error = exc
            if not nc.is_connected and is_auth_error(exc):
                if not refused.done():  # said once, by the caller
                    reasons.append(exc)
                    refused.set_result(None)
                return
            await self._on_error(exc)

        # drain_timeout: nats-py's drain() swallows a cancel and then flushes (up to 10 s), so
        # close()'s bound only holds if the drain ends by itself first
        options: dict[str, Any] = dict(
            name=self.name, connect_timeout=timeout_s, reconnect_time_wait=0.25, drain_timeout=1.5,
            max_reconnect_attempts=-1, ping_interval=2, max_outstanding_pings=3,
            allow_reconnect=True, dont_randomize=True, error_cb=on_error,
            disconnected_cb=self._on_disconnect,
            reconnected_cb=self._on_reconnect, **kwargs)
        connecting = asyncio.ensure_future(nc.connect(servers, **options))
        try:
            await asyncio.wait([connecting, refused], return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not connecting.done():  # (refused, or this call was cancelled)
                connecting.cancel()
                await asyncio.gather(connecting, return_exceptions=True)
                await asyncio.gather(nc.close(), return_exceptions=True)
        if refused.done() and not nc.is_connected:
            raise NatsAuthError(f"NATS refused {self.name}'s credentials ({reasons[0]}); "
                                "check the user and password or credentials file")
        connecting.result()  # (raises what the connect raised)
        self.nc = nc

    # One line per event, at most one error line per few seconds: an outage must not fill
    # the log with nats-py's tracebacks (it retries every 0.25 s).
    async def _on_error(self, exc: Exception) -> None:
        if self._closing:  # our own close: the connection going away is the point
            return
        now = time.monotonic()
        if now - self._last_error_log > 5.0:
            self._last_error_log = now
            log.warning("%s: NATS error: %s", self.name, exc or type(exc).__name__)

    async def _on_disconnect(self) -> None:
        if self._closing:
            log.debug("%s: disconnected from NATS (closing)", self.name)
            return
        log.warning("%s: disconnected from NATS; reconnecting", self.name)

    async def _on_reconnect(self) -> None:
        self.last_reconnect_at = time.monotonic()
        self.reconnects += 1
        log.info("%s: reconnected to NATS", self.name)

    async def publish(self, subject: str, message: Message) -> None:
        assert self.nc is not None, "connect first"
        payload, headers = encode(message), inject_headers()
        limit = self.nc.max_payload - 1024  # room for the headers
        if len(payload) <= limit:
            await self.nc.publish(subject, payload, headers=headers or None)
            return
        frame_id, count = uuid.uuid4().hex, -(-len(payload) // limit)
        view = memoryview(payload)
        for index in range(count):
            await self.nc.publish(subject, bytes(view[index * limit : (index + 1) * limit]),
                                  headers={**headers,
                                           FRAME_HEADER: f"{frame_id} {index} {count} {self.name}"})

    async def subscribe(self, subject: str, handler: Handler) -> None:
        """Route every message on `subject` to `handler(message, trace_context)`, in order.

        Through nats-py's callback task, not its message iterator: the iterator makes a task
        and an asyncio.wait per message (~15 µs) and yields to the loop after each, so a read
        holding many messages was handled one loop round apiece; the callback task takes what
        is queued back to back (the gateway's socket writes for them coalesce: direct.py)."""
        assert self.nc is not None, "connect first"
        frames = self.frames
        if self._expiry is None:
            self._expiry = asyncio.create_task(self._expire_frames(), name="frame expiry")

        async def on_message(raw: Msg) -> None:
            frame = (raw.headers or {}).get(FRAME_HEADER)
            if frame is None:
                await self._dispatch(raw.subject, raw.data, raw.headers, handler)
                return
            payload = frames.add(frame, raw.data)
            if payload is not None:
                await self._dispatch(raw.subject, payload, raw.headers, handler)

        # (what nats-py queues before reassembly sees it is bounded too: a subscriber that
        # falls this far behind loses messages, which nats-py reports as a slow consumer)
        self._subs.append(await self.nc.subscribe(
            subject, cb=on_message, pending_msgs_limit=1_000_000,
            pending_bytes_limit=max(self.budget.total_bytes, 64 * 2**20)))

    async def _expire_frames(self) -> None:
        """Incomplete framed messages go at their timeout even when no frame comes after."""
        while True:
            await asyncio.sleep(max(0.5, self.budget.timeout_s / 4))
            self.frames.expire()

    def _count_dropped(self, reason: str) -> None:
        self.dropped += 1
        MESSAGES_DROPPED.labels(service=self.name, reason=drop_kind(reason)).inc()
        log.warning("dropped a message: %s", reason)

    async def _dispatch(self, subject: str, data: bytes, headers: dict | None,
                        handler: Handler) -> None:
        reason = await deliver(subject, data, extract_context(headers), handler)
        if reason is not None:
            self._count_dropped(f"{subject}: {reason}")

    async def close(self) -> None:
        """Drain: finish delivering what arrived, then close the connection. The listeners
        run while it drains (a subscription's drain waits for its queue to be read: with them
        cancelled first, every close waited out its 2 s bound and logged a lost future)."""
        self._closing = True
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if self.nc is not None and not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), timeout=2)
            except Exception:  # already gone: nothing left to drain
                try:
                    await asyncio.wait_for(self.nc.close(), timeout=2)
                except Exception:  # the server is gone too: nothing to tell it
                    pass
