"""The balancer actor: expert load in from every worker -> a sliding window per role -> when
a role's placement in force has grown unbalanced on that window, a migration-aware new
placement for that role -> stored in Redis with its version (a restarted balancer or a late
worker gets it) -> published. Workers of the role apply it between steps and report load under
it, which acknowledges the version. A balancer that dies leaves the last placements in force.

The placement is computed in a thread (role_balance.plan_placement), one at a time per role: for
a large model it takes long enough to stall the event loop, and NATS with it.

Placements are per role (prefill and decode load differ; `eplb_per_role`, on by default), each
with its own version sequence. Expert-parallel ranks' step timings (in the same load reports)
become Prometheus series per rank and per DEP group (balancer/rank_stats.py).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging

from prometheus_client import start_http_server

from evenflow import models
from evenflow.balancer.policy import TriggerConfig
from evenflow.balancer.rank_stats import RankStats
from evenflow.balancer.role_balance import PlanInputs, RoleBalance, malformed, plan_placement
from evenflow.proto import subjects
from evenflow.proto.messages import ExpertLoad, ExpertPlacement, Message, Role
from evenflow.proto.messages import decode as decode_message
from evenflow.proto.messages import encode as encode_message
from evenflow.services.redis_conn import connect_redis
from evenflow.services.worker import WorkerService

log = logging.getLogger(__name__)
PLACEMENT_KEY = "eplb:placement"  # under the mesh's Redis prefix (kv_index/store.py's layout)
ENGINE_ROLES = (Role.PREFILL.value, Role.DECODE.value)


def placement_key(role: str) -> str:
    """The Redis key (under the mesh's prefix) of a role's placement ("": every role's)."""
    return PLACEMENT_KEY + (f":{role}" if role else "")


class BalancerService(WorkerService):
    role = Role.BALANCER

    async def start(self) -> None:
        cfg = self.config
        model_dir = models.resolve_model(cfg.model)
        assert model_dir is not None, f"unknown model {cfg.model!r}"
        raw = json.loads((model_dir / "config.json").read_text())
        num_experts = int(raw.get("n_routed_experts") or raw.get("num_local_experts")
                          or raw.get("num_experts") or 0)
        trigger = TriggerConfig(cfg.eplb_threshold, cfg.eplb_min_interval_reports,
                                cfg.eplb_window_reports)
        roles = ENGINE_ROLES if cfg.eplb_per_role else ("",)
        self.roles = {r: RoleBalance(r, num_experts, cfg.num_ep_ranks, trigger) for r in roles}
        self.rank_stats = RankStats()
        self._planning: dict[str, asyncio.Task] = {}  # role -> its placement being computed
        self.redis = connect_redis(cfg.redis_url) if cfg.redis_url else None
        for state in self.roles.values():
            await self._restore(state)
        if cfg.balancer_metrics_port:
            start_http_server(cfg.balancer_metrics_port, addr="127.0.0.1")
        self._announcer = asyncio.create_task(self._announce(), name="announce placement")
        await self.bus.subscribe(subjects.EXPERT_LOAD, self._on_load)

    async def shutdown(self) -> None:
        self._announcer.cancel()
        for task in list(self._planning.values()):
            task.cancel()
        await asyncio.gather(*self._planning.values(), return_exceptions=True)
        if self.redis is not None:
            await self.redis.aclose()

    async def _restore(self, state: RoleBalance) -> None:
        """Adopt the role's stored placement, if any (a restarted balancer keeps the version)."""
        if self.redis is None:
            return
        try:
            raw = await self.redis.get(self.config.redis_prefix + placement_key(state.role))
        except Exception:  # Redis down: start from what the workers report
            return
        stored = decode_message(raw.encode() if isinstance(raw, str) else raw) if raw else None
        if isinstance(stored, ExpertPlacement):
            state.adopt(stored)
            state.stored_version = stored.version
            log.info("restored %s placement version %d", state.label, stored.version)

    async def _announce(self) -> None:
        """Re-publish the placements in force now and then, for workers that joined late, and
        store one again if an earlier store failed."""
        while True:
            await asyncio.sleep(2.0)
            for state in self.roles.values():
                if state.version > 0:
                    self.send(subjects.EXPERT_PLACEMENT, state.message())
                    if state.stored_version < state.version:
                        await self._store_newest(state)

    def _on_load(self, message: Message, _ctx: object) -> None:
        if not isinstance(message, ExpertLoad) or message.num_slots == 0:
            return
        if malformed(message):
            return
        self.rank_stats.observe(message)
        state = self.roles.get(message.role if self.config.eplb_per_role else "")
        if state is None:
            return  # a role without expert load of its own (or an old worker's report)
        inputs = state.take(message)
        if inputs is not None and state.role not in self._planning:  # (else: next time due)
            task = asyncio.create_task(self._plan(state, inputs), name=f"plan {state.label}")
            self._planning[state.role] = task
            task.add_done_callback(functools.partial(self._planned, state.role))

    async def _plan(self, state: RoleBalance, inputs: PlanInputs) -> None:
        plan = await asyncio.to_thread(plan_placement, inputs)
        placement = state.commit(plan)
        if placement is not None:
            self.send(subjects.EXPERT_PLACEMENT, placement)
            await self._store_newest(state)

    def _planned(self, role: str, task: asyncio.Task) -> None:
        self._planning.pop(role, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("computing the %s placement failed", role or "all",
                      exc_info=task.exception())

    async def _store_newest(self, state: RoleBalance) -> None:
        """Store the role's placement in force. One store at a time, each writing the newest
        version when its turn comes: two quick rebalances cannot leave the older one in Redis.
        A failed store (Redis down) is retried by the announcer."""
        if self.redis is None:
            return
        async with state.store_lock:
            if state.stored_version >= state.version:
                return
            message = state.message()
            try:
                await self.redis.set(self.config.redis_prefix + placement_key(state.role),
                                     encode_message(message))
            except Exception as exc:
                log.warning("could not store %s placement %d (%s); retrying later",
                            state.label, message.version, exc)
                return
            state.stored_version = message.version
