"""The gateway's client of the worker fleet, in three parts: the fleet itself (fleet.py: the
NATS connection, the inbox, heartbeats, the index copy), routing and sending an attempt
(dispatch.py), and one request's attempts, retries and delivery (attempts.py).
`GatewayClient.generate()`: route -> send -> yield token deltas until finished.

Routing state lives with its owners: predictions in the KV index client, this gateway's
in-flight load in the worker registry.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable

from opentelemetry import trace

from evenflow.gateway.attempts import Attempts, deadline_function
from evenflow.gateway.dispatch import Dispatcher
from evenflow.gateway.fleet import Fleet
from evenflow.gateway.flight import RequestFailed, Served
from evenflow.gateway.router import WorkerRegistry
from evenflow.gateway.timings import FirstTokenTimings
from evenflow.proto.messages import ProfileResult, TokenDelta
from evenflow.proto.sampling import SamplingParams
from evenflow.services.bus import Bus, MessageBus
from evenflow.services.config import MeshConfig

__all__ = ["GatewayClient", "RequestFailed", "Served"]


class GatewayClient:
    def __init__(self, config: MeshConfig, tracer: trace.Tracer, salt: bytes,
                 bus: MessageBus | None = None) -> None:
        self.gateway_id = uuid.uuid4().hex[:12]
        self.fleet = Fleet(config, bus or Bus(f"gateway-{self.gateway_id}",
                                              config.reassembly_budget()), self.gateway_id)
        self.dispatch = Dispatcher(config, self.fleet, tracer, salt)

    @property
    def registry(self) -> WorkerRegistry:
        return self.fleet.registry

    @property
    def bus(self) -> MessageBus:
        return self.fleet.bus

    async def start(self) -> None:
        await self.fleet.start()

    async def close(self) -> None:
        await self.fleet.close()

    def ready(self) -> bool:
        return self.fleet.ready()

    async def profile(self, worker_id: str, steps: int, timeout_s: float) -> ProfileResult:
        return await self.fleet.profile(worker_id, steps, timeout_s)

    def generate(self, prompt: list[int], spec: SamplingParams, request_id: str | None = None,
                 deadline: float | Callable[[], float] | None = None,
                 timings: FirstTokenTimings | None = None,
                 served: Served | None = None) -> AsyncIterator[TokenDelta]:
        """The request's deltas until one carries a finish reason; raises RequestFailed.
        `deadline` (time.monotonic()), or a function giving it (read at every delta: a
        gateway's drain moves it closer): past it the request fails with TIMEOUT, also while
        deltas keep coming. `timings`: marked when its first delta is taken (with when its
        attempt was published). `served`: filled in with where the request ran (its first
        token's attempt)."""
        return self.attempts(prompt, spec, request_id, deadline, timings, served).deltas()

    def attempts(self, prompt: list[int], spec: SamplingParams, request_id: str | None = None,
                 deadline: float | Callable[[], float] | None = None,
                 timings: FirstTokenTimings | None = None,
                 served: Served | None = None) -> Attempts:
        """The request's flight, not started: `generate`'s, whose `direct` may be set first
        (gateway/direct.py)."""
        return Attempts(self.fleet, self.dispatch, prompt, spec, request_id or uuid.uuid4().hex,
                        deadline_function(deadline), timings, served)
