"""A streamed request's time to first token at the gateway, split into phases that follow each
other with no gap, and exported as `evenflow_ttft_phase_seconds{phase}` (services/metrics.py).

    received   the chat/completions handler starts (the body parsed and validated)
    tokenized  the prompt tokenized (a grammar compiled, if any)          -> "tokenize"
    admitted   a concurrency slot taken                                   -> "admission"
    published  routed, and the request published to its worker          -> "route"
    first      the first token's delta taken by the request's stream; its worker said how long
               the request waited for its engine ("worker queue") and how long the prompt
               took to the first token ("worker compute"); the rest of the interval is the
               NATS hops and both services' event loops                    -> "NATS hops"
    chunk      the first SSE chunk handed to the server (detokenized, rendered) -> "first chunk"

"total" is received -> chunk. A re-sent request (a worker failed before its first token) counts
from its last publish; its earlier attempts fall into "route". What the client sees beyond
"total" (its HTTP request, uvicorn's parsing, the chunk's way back) is the client's TTFT minus
this total: `evenflow doctor` shows it as its own row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from evenflow.services.metrics import TTFT_PHASE_SECONDS

PHASES = ("tokenize", "admission", "route", "worker queue", "worker compute", "NATS hops",
          "first chunk")
_OBSERVERS = {phase: TTFT_PHASE_SECONDS.labels(phase=phase) for phase in (*PHASES, "total")}


@dataclass
class FirstTokenTimings:
    """time.perf_counter() marks of one request; zero: not reached (yet)."""

    received: float
    tokenized: float = 0.0
    admitted: float = 0.0
    published: float = 0.0
    first: float = 0.0
    queued_s: float = 0.0
    computed_s: float = 0.0
    observed: bool = False

    def first_delta(self, published: float, queued_s: float, computed_s: float) -> None:
        """The first delta is taken now; its attempt was published at `published`."""
        if not self.first:
            self.published, self.first = published, time.perf_counter()
            self.queued_s, self.computed_s = queued_s, computed_s

    def phases(self, chunk: float) -> dict[str, float]:
        """Seconds per phase (and "total") for a first chunk at `chunk`."""
        worker = max(0.0, min(self.queued_s + self.computed_s, self.first - self.published))
        queued = min(self.queued_s, worker)
        return {"tokenize": self.tokenized - self.received,
                "admission": self.admitted - self.tokenized,
                "route": self.published - self.admitted,
                "worker queue": queued, "worker compute": worker - queued,
                "NATS hops": self.first - self.published - worker,
                "first chunk": chunk - self.first, "total": chunk - self.received}

    def first_chunk(self) -> None:
        """The first chunk goes out now: observe the phases (once; not if a mark is missing)."""
        if self.observed or not (self.admitted and self.published and self.first):
            return
        self.observed = True
        for phase, seconds in self.phases(time.perf_counter()).items():
            _OBSERVERS[phase].observe(max(0.0, seconds))
