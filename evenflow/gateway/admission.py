"""Admission at a gateway: how many requests run at once, who waits, who goes next, and who is
refused, by tenant and priority.

At most `max_inflight` requests run; up to `max_queued` more wait for a slot. When a slot frees,
the next request is chosen:

- **by tenant first**: the tenant furthest under its weighted share of the running slots
  (running / weight), so a flood from one tenant cannot take another's share; between tenants
  equally far under it, the one with the least weighted service so far (start-time fair
  queuing on requests: each grant advances its tenant's virtual clock by 1 / weight, and a
  tenant that starts waiting joins at the clock of the latest grant, banking nothing).
  Tenants come from the API key (`key tenant` lines in the key file or EVENFLOW_API_KEYS), or
  from a header the operator names (`tenant_header`, e.g. set by a proxy in front); weights
  from `tenant_weights` (`gold=4,free=1`; unnamed tenants weigh 1).
- **then by priority** within the tenant (vLLM's meaning: lower is sooner), aged so nothing
  starves: a waiter gains one level per `aging_s` seconds queued. Its key, priority +
  enqueued / aging_s, is fixed when it queues, so aging needs no re-sorting; ties go in
  arrival order.

A request whose priority ranks above a running one's does not wait for a slot: it starts past
the limit (up to a quarter more), and the engine, whose batch is full, preempts the worse one
for it (engine/core/scheduler.py); only while its tenant runs less than its weighted share, so
priority does not buy one tenant another's share.

A full queue refuses with 429 and says which limit: an arrival whose tenant holds less than its
weighted share of the queue pushes out the newest, lowest-priority waiter of the tenant most
over its share (that one gets the 429, `code: "tenant_over_share"`); otherwise the arrival is
refused (`code: "overloaded"`, the gateway's queue is full). Requests that start at once (a
free slot, nobody waiting) cost one counter each: the common case stays cheap.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from dataclasses import dataclass, field

from evenflow.gateway.protocol import APIError
from evenflow.services.metrics import (
    ADMISSION_REFUSALS,
    ADMISSION_WAIT_SECONDS,
    QUEUED_REQUESTS,
    labelled,
)

DEFAULT_TENANT = "default"
# A waiter gains one priority level per this many seconds queued: slow enough that priority
# holds through an overload burst (at 1 s a level, a low-priority request two levels down
# overtook every new high one after 2 s: bench admission), fast enough that nothing waits
# forever behind a steady stream of better ones.
AGING_S = 10.0
# Past the running limit, a request that ranks above a running one may still start, up to this
# share of max_inflight more: the engine then preempts the worse one for it (its running cap),
# instead of the better one waiting for a slot to free.
PRIORITY_HEADROOM = 0.25


def priority_class(priority: int) -> str:
    """A bounded label for metrics: high (< 0), normal (0) or low (> 0)."""
    return "high" if priority < 0 else "low" if priority > 0 else "normal"


@dataclass(eq=False)
class _Waiter:
    tenant: str
    priority: int
    enqueued: float
    future: asyncio.Future[Slot] = field(repr=False)
    gone: bool = False  # cancelled or pushed out: skipped when it comes up


class Slot:
    """A running request's place; `release()` gives it back (once, whoever calls it)."""

    __slots__ = ("_admission", "tenant", "priority", "_released")

    def __init__(self, admission: Admission, tenant: str, priority: int = 0) -> None:
        self._admission, self.tenant, self.priority = admission, tenant, priority
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release(self.tenant, self.priority)


class Admission:
    def __init__(self, max_inflight: int, max_queued: int,
                 weights: dict[str, float] | None = None, aging_s: float = AGING_S) -> None:
        self.max_inflight, self.max_queued = max_inflight, max_queued
        self.weights = dict(weights or {})
        self.aging_s = aging_s
        self.running = 0
        self.queued = 0
        self.headroom = int(max_inflight * PRIORITY_HEADROOM)
        self._running_by: dict[str, int] = {}
        self._priorities: dict[int, int] = {}  # running requests by priority (nonzero ones)
        self._queued_by: dict[str, int] = {}
        self._queues: dict[str, list[tuple[float, int, _Waiter]]] = {}
        self._order = itertools.count()
        self._vtime: dict[str, float] = {}  # each tenant's virtual clock (weighted grants)
        self._clock = 0.0  # the virtual clock of the latest grant

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def label(self, tenant: str) -> str:
        """The tenant as a metric label: named ones by name, the rest as "other" (a header
        names tenants freely; a label per name would grow without bound)."""
        return tenant if tenant in self.weights or tenant == DEFAULT_TENANT else "other"

    async def acquire(self, tenant: str = DEFAULT_TENANT, priority: int = 0) -> Slot:
        """A slot now, or once the rules above give one; APIError(429) when refused."""
        if self.running < self.max_inflight and not self.queued:
            return self._grant(tenant, priority)
        if self._outranks(priority) and self._within_share(tenant):
            return self._grant(tenant, priority)
        if self.queued >= self.max_queued:
            self._make_room(tenant)
        now = time.monotonic()
        waiter = _Waiter(tenant, priority, now, asyncio.get_running_loop().create_future())
        key = priority + now / self.aging_s if self.aging_s > 0 else float(priority)
        if tenant not in self._queued_by:  # it starts waiting: no credit for its idle time
            self._vtime[tenant] = max(self._vtime.get(tenant, 0.0), self._clock)
        heapq.heappush(self._queues.setdefault(tenant, []), (key, next(self._order), waiter))
        self._queue_count(tenant, +1)
        try:
            slot = await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled() \
                    and waiter.future.exception() is None:
                waiter.future.result().release()  # granted as the caller left: given back
            elif not waiter.gone:
                waiter.gone = True
                self._queue_count(tenant, -1)
            raise
        labelled(ADMISSION_WAIT_SECONDS, priority_class(priority)).observe(
            time.monotonic() - now)
        return slot

    # -- internals ----------------------------------------------------------------------------
    def _outranks(self, priority: int) -> bool:
        """Whether a request of this priority may start past the limit: a running one ranks
        below it, and the headroom is not used up."""
        if self.running >= self.max_inflight + self.headroom:
            return False
        worst = max(self._priorities, default=0)
        if self.running > sum(self._priorities.values()):  # priority-0 requests run too
            worst = max(worst, 0)
        return priority < worst

    def _within_share(self, tenant: str) -> bool:
        """Whether the tenant runs no more than its weighted share of the slots (among the
        tenants running or waiting): priority does not buy one tenant another's share."""
        tenants = set(self._running_by) | set(self._queued_by) | {tenant}
        return len(tenants) == 1 or \
            self._running_by.get(tenant, 0) < self._part(self.max_inflight, tenant, tenants)

    def _grant(self, tenant: str, priority: int = 0) -> Slot:
        if priority:
            self._priorities[priority] = self._priorities.get(priority, 0) + 1
        self._clock = vtime = self._vtime.get(tenant, self._clock)
        self._vtime[tenant] = vtime + 1.0 / self.weight(tenant)
        self.running += 1
        self._running_by[tenant] = self._running_by.get(tenant, 0) + 1
        return Slot(self, tenant, priority)

    def _release(self, tenant: str, priority: int = 0) -> None:
        if priority:
            left = self._priorities[priority] - 1
            if left:
                self._priorities[priority] = left
            else:
                del self._priorities[priority]
        self.running -= 1
        left = self._running_by[tenant] - 1
        if left:
            self._running_by[tenant] = left
        else:
            del self._running_by[tenant]
            if tenant not in self._queued_by and self._vtime.get(tenant, 0.0) <= self._clock:
                self._vtime.pop(tenant, None)  # (it would rejoin at the clock anyway)
        while self.queued and self.running < self.max_inflight:
            waiter = self._next_waiter()
            if waiter is None:
                break
            waiter.future.set_result(self._grant(waiter.tenant, waiter.priority))

    def _queue_count(self, tenant: str, change: int) -> None:
        self.queued += change
        count = self._queued_by.get(tenant, 0) + change
        if count:
            self._queued_by[tenant] = count
        else:
            self._queued_by.pop(tenant, None)
        labelled(QUEUED_REQUESTS, self.label(tenant)).inc(change)

    def _head(self, tenant: str) -> _Waiter | None:
        queue = self._queues.get(tenant)
        while queue and queue[0][2].gone:
            heapq.heappop(queue)
        if not queue:
            self._queues.pop(tenant, None)
            return None
        return queue[0][2]

    def _next_waiter(self) -> _Waiter | None:
        """The best waiter of the tenant furthest under its share of the running slots."""
        best: tuple[float, float, float, int] | None = None
        chosen = None
        for tenant in list(self._queues):
            if self._head(tenant) is None:
                continue
            key, order, _ = self._queues[tenant][0]
            rank = (self._running_by.get(tenant, 0) / self.weight(tenant),
                    self._vtime.get(tenant, 0.0), key, order)
            if best is None or rank < best:
                best, chosen = rank, tenant
        if chosen is None:
            return None
        waiter = heapq.heappop(self._queues[chosen])[2]
        waiter.gone = True
        self._queue_count(chosen, -1)
        return waiter

    def _share(self, tenant: str, arriving: str = "") -> float:
        """The tenant's weighted share of the queue among the tenants waiting, it and the one
        arriving."""
        tenants = set(self._queued_by) | {tenant} | ({arriving} if arriving else set())
        return self._part(self.max_queued, tenant, tenants)

    def _part(self, total: int, tenant: str, tenants: set[str]) -> float:
        """The tenant's weighted part of `total` among `tenants`."""
        return total * self.weight(tenant) / sum(self.weight(t) for t in tenants)

    def _make_room(self, tenant: str) -> None:
        """The queue is full: push out a waiter of the tenant most over its share if `tenant`
        is under its own, else refuse the arrival (429, saying which limit)."""
        mine = self._queued_by.get(tenant, 0)
        if mine + 1 <= self._share(tenant):
            over = max((t for t in self._queued_by if t != tenant),
                       key=lambda t: self._queued_by[t] - self._share(t, tenant), default=None)
            if over is not None and self._queued_by[over] > self._share(over, tenant):
                self._push_out(over)
                return
        others = any(t != tenant for t in self._queued_by)
        raise self._refusal(tenant, "tenant_over_share" if others and mine >= self._share(tenant)
                            else "overloaded")

    def _push_out(self, tenant: str) -> None:
        """Refuse the tenant's worst waiter (lowest priority, newest) to make room."""
        queue = self._queues[tenant]
        index = max((i for i, entry in enumerate(queue) if not entry[2].gone),
                    key=lambda i: (queue[i][0], queue[i][1]))
        waiter = queue[index][2]
        waiter.gone = True
        self._queue_count(tenant, -1)
        waiter.future.set_exception(self._refusal(tenant, "tenant_over_share"))

    def _refusal(self, tenant: str, code: str) -> APIError:
        labelled(ADMISSION_REFUSALS, code).inc()
        if code == "tenant_over_share":
            share = self._share(tenant)
            message = (f"Tenant {tenant!r} has its share of this gateway's queue "
                       f"({share:.0f} of {self.max_queued} waiting requests, by weight "
                       f"{self.weight(tenant):g}); retry later.")
        else:
            message = (f"Too many requests are queued at this gateway ({self.max_queued} "
                       "waiting); retry later.")
        return APIError(429, message, "rate_limit_error", code=code,
                        headers={"Retry-After": "1"})
