"""Routing state shared between gateways, as Dynamo's router replicas sync theirs: each gateway
sends the others (RouterSync on its own subject, every router_sync_interval_s while it changes)
its in-flight load on each worker and the prefixes it routed since its last sync. A receiver
counts a peer's fresh load in place of what the workers' heartbeats (older, by up to a
heartbeat interval) say for that peer (router.current_load), and takes its routed prefixes as
predictions of its own (kv_index/client.py), so N gateways route one conversation's turns to
the worker that holds it as one gateway would, and do not all pile onto the worker that looked
idlest at its last heartbeat."""

from __future__ import annotations

import asyncio
import logging
import time

from opentelemetry.context import Context

from evenflow.gateway.router import PeerLoad, WorkerRegistry
from evenflow.kv_index.client import KVIndexClient
from evenflow.proto import subjects
from evenflow.proto.messages import Message, RoutedPrefix, RouterSync
from evenflow.services.bus import MessageBus

log = logging.getLogger(__name__)

MAX_ROUTED_PER_SYNC = 1024  # prefixes beyond this in one interval are not shared (load still is)


class PeerGateways:
    def __init__(self, own_subject: str, registry: WorkerRegistry, kv: KVIndexClient | None,
                 interval_s: float) -> None:
        self.own, self.registry, self.kv, self.interval_s = own_subject, registry, kv, interval_s
        self._routed: list[RoutedPrefix] = []
        self._sent: tuple[dict[str, int], dict[str, int]] = ({}, {})
        self._sent_at = 0.0
        registry.peer_fresh_s = max(2.0, 4 * interval_s)

    def routed(self, block_hashes: list[int], worker_ids: list[str]) -> None:
        """This gateway just sent a prompt with these block hashes to these workers."""
        if self.interval_s > 0 and block_hashes and len(self._routed) < MAX_ROUTED_PER_SYNC:
            self._routed += [RoutedPrefix(worker_id=w, block_hashes=block_hashes)
                             for w in worker_ids]

    def on_sync(self, message: Message, _ctx: Context) -> None:
        if not isinstance(message, RouterSync) or message.gateway_id == self.own:
            return
        self.registry.peers[message.gateway_id] = PeerLoad(
            time.monotonic(), message.inflight, message.inflight_blocks)
        if self.kv is not None:
            for prefix in message.routed:
                self.kv.remember(prefix.block_hashes, (prefix.worker_id,))

    def next_sync(self, now: float) -> RouterSync | None:
        """What to send now: None when nothing changed since the last sync, and that one is
        recent enough for the peers to still count it fresh."""
        workers = self.registry.workers.values()
        load = ({s.worker_id: s.inflight for s in workers if s.inflight},
                {s.worker_id: s.inflight_blocks for s in workers if s.inflight_blocks})
        stale = now - self._sent_at > self.registry.peer_fresh_s / 2
        if not self._routed and load == self._sent and not (stale and any(load)):
            return None
        routed, self._routed = self._routed, []
        self._sent, self._sent_at = load, now
        return RouterSync(gateway_id=self.own, inflight=load[0], inflight_blocks=load[1],
                          routed=routed)

    async def run(self, bus: MessageBus) -> None:
        """Send this gateway's syncs until cancelled (a failed send: the next one carries the
        load; the routed prefixes of the failed one are lost, which costs stickiness only)."""
        while True:
            await asyncio.sleep(self.interval_s)
            sync = self.next_sync(time.monotonic())
            if sync is None:
                continue
            try:
                await bus.publish(subjects.router_sync(self.own.rsplit(".", 1)[-1]), sync)
            except Exception as exc:  # NATS down: the bus reconnects
                log.debug("router sync not sent: %s", exc)
