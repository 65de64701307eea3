"""One request's state in the fleet, as data: where its current attempt runs and what it waits
for (`Flight`), where it ran for its log line (`Served`), and how it failed (`RequestFailed`).
The behaviour lives in dispatch.py (routing and sending an attempt) and attempts.py (the
attempts, retries and delivery)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from evenflow.gateway.replies import DeltaQueue
from evenflow.proto.messages import ErrorMessage, TokenDelta


class RequestFailed(Exception):
    """A request the fleet could not serve; `code` is one of proto.errors."""

    def __init__(self, code: str, description: str) -> None:
        super().__init__(description)
        self.code, self.description = code, description


@dataclass
class Flight:
    """One request in flight: its reply queue and where it runs now."""

    queue: asyncio.Queue[TokenDelta | ErrorMessage] = field(default_factory=DeltaQueue)
    prefill: str | None = None
    decode: str | None = None
    prefill_blocks: int = 0  # blocks the prefill worker was expected to compute
    # decode workers that refused it for lack of room -> when: not tried again before their
    # next heartbeat (which says whether room came back)
    refused: dict[str, float] = field(default_factory=dict)
    admit_by: float | None = None  # waiting for room since: give up at this time.monotonic()
    waited_s: float = 0.0  # waiting for a decode worker with room (not routing time)
    no_worker_since: float = 0.0  # migrating with no decode worker live, since (monotonic)
    published_at: float = 0.0  # time.perf_counter() when its latest attempt was published
    expected_cached_tokens: int = 0  # what the router expected the computing worker to hold
    # offered each delta before the queue (Attempts.offer): True when it took it
    tap: Callable[[TokenDelta], bool] | None = None


@dataclass
class Served:
    """Where a request ran, for its log line, as of its first token: the prefill worker ("":
    the decode worker prefilled), the decode worker, and the prompt tokens the router expected
    the worker computing the prompt to find cached (the KV index's match: a shortfall against
    the cached tokens reported is a miss)."""

    prefill: str = ""
    decode: str = ""
    expected_cached_tokens: int = 0

    def workers(self) -> str:
        """e.g. "p0->d0", "d0" (prefilled by the decode worker), "-" (not routed)."""
        return "->".join(w for w in (self.prefill, self.decode) if w) or "-"
