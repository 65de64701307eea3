"""The balancer actor: expert load in from every worker -> a sliding window -> when the
placement in force has grown unbalanced on that window, a migration-aware new placement ->
stored in Redis with its version (a restarted balancer or a late worker gets it) -> published.
Workers apply it between steps and report load under it, which acknowledges the version.
A balancer that dies leaves the last placement in force."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import torch
from prometheus_client import Counter, Gauge, start_http_server

from evenflow import models
from evenflow.balancer.eplb import balancedness, rebalance_from, replica_shares, slots_moved
from evenflow.balancer.policy import ThresholdTrigger, TriggerConfig
from evenflow.proto import subjects
from evenflow.proto.messages import ExpertLoad, ExpertPlacement, Message, Role
from evenflow.proto.messages import decode as decode_message
from evenflow.proto.messages import encode as encode_message
from evenflow.services.redis_conn import connect_redis
from evenflow.services.worker import WorkerService

log = logging.getLogger(__name__)
PLACEMENT_KEY = "eplb:placement"  # under the mesh's Redis prefix (kv_index/store.py's layout)

VERSION = Gauge("evenflow_eplb_placement_version", "Placement version in force")
BALANCEDNESS = Gauge("evenflow_eplb_balancedness", "Rank balancedness on the load window",
                     ["when"])
SLOTS_MOVED = Counter("evenflow_eplb_slots_moved_total", "Expert slots moved by rebalances")
COMPUTE_SECONDS = Gauge("evenflow_eplb_compute_seconds", "Time to compute the last placement")
ACKED = Gauge("evenflow_eplb_workers_on_version", "Workers reporting load under the version")


class BalancerService(WorkerService):
    role = Role.BALANCER
    MIN_GAIN = 0.01  # a new placement must raise balancedness by this much

    async def start(self) -> None:
        cfg = self.config
        model_dir = models.resolve_model(cfg.model)
        assert model_dir is not None, f"unknown model {cfg.model!r}"
        raw = json.loads((model_dir / "config.json").read_text())
        self.num_experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
        self.num_ranks = cfg.num_ep_ranks
        self.trigger = ThresholdTrigger(TriggerConfig(
            cfg.eplb_threshold, cfg.eplb_min_interval_reports, cfg.eplb_window_reports),
            self.num_ranks)
        self.version = 0
        self.phy2log: torch.Tensor | None = None  # (layers, slots) of the version in force
        self.shares: torch.Tensor | None = None
        self.history: dict[int, torch.Tensor] = {}  # recent versions' phy2log
        self.worker_versions: dict[str, int] = {}
        self.redis = connect_redis(cfg.redis_url) if cfg.redis_url else None
        self._store_lock = asyncio.Lock()
        self.stored_version = 0  # the newest version known to be in Redis
        await self._restore()
        if cfg.balancer_metrics_port:
            start_http_server(cfg.balancer_metrics_port, addr="127.0.0.1")
        self._announcer = asyncio.create_task(self._announce(), name="announce placement")
        await self.bus.subscribe(subjects.EXPERT_LOAD, self._on_load)

    async def shutdown(self) -> None:
        self._announcer.cancel()
        if self.redis is not None:
            await self.redis.aclose()

    async def _restore(self) -> None:
        """Adopt the stored placement, if any (a restarted balancer keeps the version)."""
        if self.redis is None:
            return
        try:
            raw = await self.redis.get(self.config.redis_prefix + PLACEMENT_KEY)
        except Exception:  # Redis down: start from what the workers report
            return
        stored = decode_message(raw.encode() if isinstance(raw, str) else raw) if raw else None
        if isinstance(stored, ExpertPlacement):
            self._adopt(stored)
            self.stored_version = stored.version
            log.info("restored placement version %d", stored.version)

    def _adopt(self, p: ExpertPlacement) -> None:
        self.version = p.version
        self.phy2log = torch.tensor(p.phy2log).view(p.num_layers, p.num_slots)
        self.shares = torch.tensor(p.shares).view(p.num_layers, p.num_slots)
        self.history[p.version] = self.phy2log
        VERSION.set(p.version)

    def _message(self) -> ExpertPlacement:
        assert self.phy2log is not None and self.shares is not None
        L, P = self.phy2log.shape
        return ExpertPlacement(version=self.version, num_layers=L, num_slots=P,
                               phy2log=self.phy2log.flatten().tolist(),
                               shares=self.shares.flatten().tolist())

    async def _announce(self) -> None:
        """Re-publish the placement in force now and then, for workers that joined late, and
        store it again if an earlier store failed."""
        while True:
            await asyncio.sleep(2.0)
            if self.version > 0:
                self.send(subjects.EXPERT_PLACEMENT, self._message())
                if self.stored_version < self.version:
                    await self._store_newest()

    def _on_load(self, message: Message, _ctx: object) -> None:
        if not isinstance(message, ExpertLoad) or message.num_slots == 0:
            return
        L, P = message.num_layers, message.num_slots
        if self.phy2log is None:  # the workers' initial placement: slot s holds s mod E
            self.phy2log = (torch.arange(P) % self.num_experts).repeat(L, 1)
            self.shares = torch.ones(L, P)
            self.history[0] = self.phy2log
        self.worker_versions[message.worker_id] = message.version
        ACKED.set(sum(1 for v in self.worker_versions.values() if v == self.version))
        layout = self.history.get(message.version)
        if layout is None or layout.shape != (L, P):
            return  # load under a placement we no longer know: skip it
        slot_counts = torch.tensor(message.counts, dtype=torch.float32).view(L, P)
        logical = torch.zeros(L, self.num_experts).scatter_add_(1, layout, slot_counts)
        if not self.trigger.observe(logical, self.phy2log, self._slot_shares()):
            return
        self._rebalance()

    def _slot_shares(self) -> torch.Tensor | None:
        """The shares in force as routing fractions per slot (None: even split)."""
        if self.version == 0 or self.shares is None:
            return None
        return self.shares

    def _rebalance(self) -> None:
        assert self.phy2log is not None
        load = self.trigger.window.load()
        before = balancedness(load, self.phy2log, self.num_ranks, self._slot_shares())
        started = time.perf_counter()
        placement = rebalance_from(self.phy2log, load, self.num_ranks)
        shares = replica_shares(load, placement.phy2log, self.num_ranks)
        COMPUTE_SECONDS.set(time.perf_counter() - started)
        after = balancedness(load, placement.phy2log, self.num_ranks, shares)
        if after < before + self.MIN_GAIN:
            return  # not worth moving weights (nor waking every worker) for

        moved = slots_moved(self.phy2log, placement.phy2log)
        self.version += 1
        self.phy2log, self.shares = placement.phy2log, shares
        self.history[self.version] = self.phy2log
        for old in [v for v in self.history if v < self.version - 4]:
            del self.history[old]
        BALANCEDNESS.labels(when="before").set(before)
        BALANCEDNESS.labels(when="after").set(after)
        SLOTS_MOVED.inc(moved)
        VERSION.set(self.version)
        log.info("placement %d: balancedness %.3f -> %.3f, %d slots moved", self.version,
                 before, after, moved)
        self.send(subjects.EXPERT_PLACEMENT, self._message())
        task = asyncio.ensure_future(self._store_newest())
        task.add_done_callback(lambda t: t.exception())

    async def _store_newest(self) -> None:
        """Store the placement in force. One store at a time, each writing the newest version
        when its turn comes: two quick rebalances cannot leave the older one in Redis. A failed
        store (Redis down) is retried by the announcer."""
        if self.redis is None:
            return
        async with self._store_lock:
            if self.stored_version >= self.version:
                return
            message = self._message()
            try:
                await self.redis.set(self.config.redis_prefix + PLACEMENT_KEY,
                                     encode_message(message))
            except Exception as exc:
                log.warning("could not store placement %d (%s); retrying later",
                            message.version, exc)
                return
            self.stored_version = message.version
