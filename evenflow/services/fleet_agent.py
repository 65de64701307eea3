"""The launcher's ear on the bus (`evenflow up --planner`): a thread with its own event loop and
NATS connection that keeps the planner's latest FleetTarget and the role each engine worker
last heartbeated in, for the launcher's synchronous supervision loop (services/launcher.py).
With them the launcher starts and stops workers to the planner's sizes (`--planner-mode
scale`, `resize_plan` here says which), and restarts a worker that had switched role in place
in the role it serves, not the one it was launched in."""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass, field

from evenflow.proto import subjects
from evenflow.proto.messages import WORKER_ROLES, FleetTarget, Message, WorkerHeartbeat
from evenflow.services.bus import Bus

log = logging.getLogger(__name__)

PREFIXES = {"prefill": "p", "decode": "d"}  # a started worker's id: p3, d1, ...


@dataclass
class ResizePlan:
    start: list[tuple[str, str]] = field(default_factory=list)  # (role, worker id)
    stop: list[str] = field(default_factory=list)  # worker ids, to drain and not restart


def resize_plan(serving: dict[str, list[str]], target: FleetTarget,
                taken: set[str]) -> ResizePlan:
    """What to start and stop so each role has the target's count. `serving`: role -> the
    workers serving it now (oldest first); `taken`: every id in use (running, or stopping).
    A role that shrinks stops the workers the planner named first, then its newest; a
    role that grows starts workers under the lowest free ids of its prefix."""
    plan = ResizePlan()
    taken = set(taken)
    for role, want in (("prefill", target.prefill), ("decode", target.decode)):
        have = list(serving.get(role, []))
        if len(have) > want:
            named = [w for w in target.retire if w in have]
            rest = [w for w in reversed(have) if w not in named]
            plan.stop += (named + rest)[:len(have) - want]
        index = 0
        for _ in range(want - len(have)):
            while f"{PREFIXES[role]}{index}" in taken:
                index += 1
            worker_id = f"{PREFIXES[role]}{index}"
            taken.add(worker_id)
            plan.start.append((role, worker_id))
    return plan


class FleetAgent:
    """Listens on the mesh's NATS from a thread of its own; the launcher polls it."""

    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url
        self._lock = threading.Lock()
        self._target: FleetTarget | None = None  # newest, not yet taken
        self._roles: dict[str, str] = {}  # worker id -> the role it last heartbeated in
        self._loop = asyncio.new_event_loop()
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="fleet agent", daemon=True)

    def start(self, timeout_s: float = 10.0) -> None:
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error is not None:
            self.stop()
            raise RuntimeError(f"the launcher could not reach NATS: {self._error!r}")

    def take_target(self) -> FleetTarget | None:
        """The planner's newest FleetTarget since the last call (None: nothing new)."""
        with self._lock:
            target, self._target = self._target, None
        return target

    def role_of(self, worker_id: str) -> str | None:
        """The role `worker_id` last heartbeated in (None: not heard from)."""
        with self._lock:
            return self._roles.get(worker_id)

    def stop(self) -> None:
        if self._stopping is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    # -- on the agent's own thread ------------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._listen())
        except BaseException as exc:  # (said by start(), or logged when it comes later)
            self._error = exc
            if self._ready.is_set():
                log.warning("launcher: the fleet agent stopped: %r", exc)
            self._ready.set()
        finally:
            self._loop.close()

    async def _listen(self) -> None:
        self._stopping = asyncio.Event()
        bus = Bus("launcher")
        await bus.connect(self.nats_url)
        try:
            await bus.subscribe(subjects.FLEET_TARGET, self._on_target)
            await bus.subscribe(subjects.HEARTBEATS, self._on_heartbeat)
            self._ready.set()
            await self._stopping.wait()
        finally:
            await bus.close()

    def _on_target(self, message: Message, _ctx: object) -> None:
        if isinstance(message, FleetTarget):
            with self._lock:
                self._target = message

    def _on_heartbeat(self, message: Message, _ctx: object) -> None:
        if isinstance(message, WorkerHeartbeat) and message.role in WORKER_ROLES:
            with self._lock:
                self._roles[message.worker_id] = str(message.role)
