"""Reassembly of framed bus messages under a memory budget, per peer and in total.

A message larger than the server's max_payload travels as numbered frames; the receiver holds the
frames until the message is whole. Frames cost memory before anything is decoded or checked, so a
sender (a bug, or a client holding stolen credentials) could make a receiver hold gigabytes by
announcing many parts and never finishing. This module bounds that: each peer may hold at most
`peer_bytes` of incomplete messages and everyone together `total_bytes`; a frame that would pass
the peer's budget drops that peer's message, one that would pass the total drops the oldest
incomplete messages of the peer holding the most. Incomplete messages also expire after
`timeout_s` (`expire`, which the bus also calls on a timer: a peer that stops sending must
not leave its frames held). Every drop has a reason the bus counts and logs. One Reassembly
serves all of a bus's subscriptions, so a peer's budget is per receiving process, not per
subject it sends on.

Frame header: `<message id> <index> <count> [<sender>]` (the sender is absent in frames from
senders older than this module, or foreign ones; they share one bucket of their own, named
"(no sender)" in the log, apart from every named peer's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

ANONYMOUS_PEER = "(no sender)"


@dataclass(frozen=True, kw_only=True)
class ReassemblyBudget:
    peer_bytes: int = 64 * 2**20
    total_bytes: int = 256 * 2**20
    max_frames: int = 100_000
    timeout_s: float = 30.0


@dataclass
class _Partial:
    peer: str
    started: float
    parts: list[bytes | None]
    held: int = 0


@dataclass
class Reassembly:
    """Incomplete framed messages of one subscription; `add` returns a message once whole."""

    budget: ReassemblyBudget = field(default_factory=ReassemblyBudget)
    on_drop: Callable[[str], None] = lambda reason: None
    clock: Callable[[], float] = time.monotonic
    _partials: dict[str, _Partial] = field(default_factory=dict)
    _held_by_peer: dict[str, int] = field(default_factory=dict)

    @property
    def held_bytes(self) -> int:
        return sum(self._held_by_peer.values())

    def held_by(self, peer: str) -> int:
        return self._held_by_peer.get(peer, 0)

    def add(self, header: str, data: bytes) -> bytes | None:
        """Store one frame; the whole payload once every frame of its message is there."""
        self.expire()
        try:
            message_id, index, count, peer = _parse(header, self.budget.max_frames)
        except ValueError:
            self.on_drop(f"bad frame header {header[:80]!r}")
            return None
        partial = self._partials.get(message_id)
        if partial is None:
            partial = self._partials[message_id] = _Partial(peer, self.clock(), [None] * count)
        if partial.peer != peer or len(partial.parts) != count or partial.parts[index] is not None:
            self._drop(message_id, "inconsistent or repeated frame")
            return None
        if self.held_by(peer) + len(data) > self.budget.peer_bytes:
            self._drop(message_id, f"peer {peer} over its reassembly budget "
                                   f"({self.budget.peer_bytes} bytes)")
            return None
        while self.held_bytes + len(data) > self.budget.total_bytes and self._shed(message_id):
            pass
        partial.parts[index] = data
        partial.held += len(data)
        self._held_by_peer[peer] = self.held_by(peer) + len(data)
        if any(p is None for p in partial.parts):
            return None
        self._forget(message_id)
        return b"".join(p for p in partial.parts if p is not None)

    def _shed(self, keep: str) -> bool:
        """Drop the oldest other incomplete message of the peer holding the most bytes."""
        heavy = max(self._held_by_peer, key=self._held_by_peer.__getitem__, default=None)
        victims = [(p.started, mid) for mid, p in self._partials.items()
                   if mid != keep and p.peer == heavy and p.held]
        if not victims:
            victims = [(p.started, mid) for mid, p in self._partials.items()
                       if mid != keep and p.held]
        if not victims:
            return False
        self._drop(min(victims)[1], "total reassembly budget exceeded")
        return True

    def expire(self) -> None:
        """Drop the incomplete messages older than the budget's timeout."""
        now = self.clock()
        for message_id in [m for m, p in self._partials.items()
                           if now - p.started > self.budget.timeout_s]:
            self._drop(message_id, "incomplete framed message timed out")

    def _drop(self, message_id: str, reason: str) -> None:
        self._forget(message_id)
        self.on_drop(reason)

    def _forget(self, message_id: str) -> None:
        partial = self._partials.pop(message_id, None)
        if partial is None:
            return
        left = self.held_by(partial.peer) - partial.held
        if left > 0:
            self._held_by_peer[partial.peer] = left
        else:
            self._held_by_peer.pop(partial.peer, None)


def _parse(header: str, max_frames: int) -> tuple[str, int, int, str]:
    fields = header.split()
    if len(fields) not in (3, 4):
        raise ValueError(header)
    index, count = int(fields[1]), int(fields[2])
    if not 0 <= index < count <= max_frames:
        raise ValueError(header)
    return fields[0], index, count, fields[3] if len(fields) == 4 else ANONYMOUS_PEER
