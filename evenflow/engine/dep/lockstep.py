"""A DEP rank as a mesh worker (`evenflow up --ep N`): an Engine whose MoE layers are expert-
parallel over a shm group with the other ranks of its group, each rank a worker of its own
(own NATS subject, heartbeats, KV cache and events), all stepping in lockstep.

The worker's engine thread (services/engine_thread.py) calls decide_step() exactly once per
loop iteration on every rank; here it is a small all-gather of [local work, pending placement
version], so every rank sees the same answer and steps (or not) together. has_unfinished() only
reads: this rank's work, or the group's last answer. A rank without work of its own still
steps: with a dummy forward pass, so every MoE collective meets. A placement arrives at each
rank separately (NATS); once every rank holds it, its MoE layers switch one per decide_step(),
so one per step, on every rank at the same call (each rank reading the experts its slots newly
hold: engine/weights/expert_store.py). A collective that fails (a rank died or hangs) makes the
engine fatal: the worker exits and its supervisor restarts it, and the group re-forms.
"""

from __future__ import annotations

import logging
import time

import torch

from evenflow.engine.config import EngineConfig, ModelLoadError, load_config
from evenflow.engine.core.block_manager import KVEventListener
from evenflow.engine.dep.offline import slot_bytes_for
from evenflow.engine.engine import Engine, StepOutput
from evenflow.engine.model.ffn import EPTimer
from evenflow.engine.model.placement import check_slots
from evenflow.engine.runners.rank_wire import LOAD_TIMEOUT_S, STEP_TIMEOUT_S
from evenflow.engine.weights.loader import resolve_model
from evenflow.parallel.group import CollectiveError
from evenflow.parallel.shm import ShmGroup

log = logging.getLogger(__name__)



class LockstepEngine(Engine):
    # Idle ranks still meet this often to agree whether there is work: every 10 ms, and every
    # 40 ms once the group has been idle for 2 s (a request arriving then waits up to that long
    # for its first step; an idle group costs a few % of a core per rank).
    BUSY_POLL_S, IDLE_POLL_S, IDLE_AFTER_S = 0.01, 0.04, 2.0
    IDLE_NAP_AFTER_S = 0.0002  # waiting for an idle peer: sleep, don't spin

    def __init__(self, config: EngineConfig, kv_event_listener: KVEventListener | None,
                 collect_kv_events: bool, ep_rank: int, group_name: str) -> None:
        cfg = load_config(resolve_model(config.model))
        if not cfg.is_moe:
            raise ModelLoadError("expert parallelism needs a MoE model")
        world = config.expert_parallel_size
        try:
            self.group = ShmGroup(group_name, ep_rank, world, timeout_s=LOAD_TIMEOUT_S,
                                  slot_bytes=slot_bytes_for(config, cfg.hidden_size,
                                                            cfg.num_experts_per_tok))
        except CollectiveError as exc:
            raise ModelLoadError(f"expert-parallel group {group_name}: {exc}") from exc
        super().__init__(config, kv_event_listener, collect_kv_events, ep_group=self.group)
        self.group.barrier()  # every rank loaded
        self.group.timeout_s = STEP_TIMEOUT_S
        self._pending: tuple[int, list[int], list[float]] | None = None
        self._fatal: str | None = None
        self._last_busy = time.monotonic()
        self._group_busy = False  # the group's answer at the last decide_step()
        self.ep_timer = EPTimer()  # MoE compute / collective time since the last report
        for layer in self.model.moe_layers():
            layer.ep_timer = self.ep_timer
        self._steps, self._step_s = 0, 0.0

    @property
    def idle_poll_s(self) -> float:  # type: ignore[override]
        idle = time.monotonic() - self._last_busy > self.IDLE_AFTER_S
        return self.IDLE_POLL_S if idle else self.BUSY_POLL_S

    @property
    def fatal_error(self) -> str | None:
        return self._fatal

    def _lost(self, exc: Exception) -> None:
        self._fatal = f"expert-parallel group lost: {exc}"

    def has_unfinished(self) -> bool:
        """This rank's own work, or the group's at the last decide_step() (a read)."""
        return self._fatal is None and (self._group_busy or super().has_unfinished())

    def decide_step(self) -> bool:
        """Whether any rank of the group has work: a collective (every rank calls it once per
        loop); a placement every rank holds begins here, and one MoE layer of it switches."""
        if self._fatal is not None:
            return False
        pending = self._pending[0] if self._pending else -1
        try:
            every = self.group.all_gather(torch.tensor(
                [int(super().has_unfinished()), pending], dtype=torch.int64),
                nap_after_s=self.IDLE_NAP_AFTER_S)
        except CollectiveError as exc:
            self._lost(exc)
            return False
        versions = every[:, 1]
        if self._pending and bool((versions == pending).all()):
            version, phy2log, shares = self._pending
            self._pending = None
            shape = tuple(self.slot_counts.shape)
            self.begin_placement(torch.tensor(phy2log).view(shape),
                                 torch.tensor(shares, dtype=torch.float32).view(shape), version)
        # every rank calls this equally often: one layer of a placement switches everywhere
        self.advance_placement()
        busy = self._group_busy = bool(every[:, 0].any())
        if busy:
            self._last_busy = time.monotonic()
        return busy

    def step(self) -> list[StepOutput]:
        """This rank's step, or a dummy forward pass when it has nothing to run."""
        if self._fatal is not None:
            raise RuntimeError(self._fatal)
        started = time.perf_counter()
        try:
            outputs = self.step_in_lockstep()
        except CollectiveError as exc:
            self._lost(exc)
            raise RuntimeError(self._fatal) from exc
        self._steps += 1
        self._step_s += time.perf_counter() - started
        return outputs

    def take_rank_timing(self) -> list[float] | None:
        """[steps, step s, MoE compute s, MoE collective s, rows] since the last call."""
        compute_s, wait_s, rows = self.ep_timer.take()
        timing = [float(self._steps), self._step_s, compute_s, wait_s, rows]
        self._steps, self._step_s = 0, 0.0
        return timing

    def apply_expert_placement(self, version: int, phy2log: list[int],
                               shares: list[float]) -> None:
        """Checked now (a bad one raises ValueError: the worker reports it and keeps serving),
        held until every rank of the group has it (see decide_step)."""
        layers, slots = self.slot_counts.shape
        if len(phy2log) != layers * slots or len(shares) != layers * slots:
            raise ValueError(f"placement has {len(phy2log)} slots, this engine {layers}x{slots}")
        held = torch.tensor(phy2log).view(layers, slots)
        for row in held:
            check_slots(row, self.model_config.num_experts, self.config.num_ep_ranks)
        if version > max(self.placement_version, self._staged.version if self._staged else -1):
            self._pending = (version, phy2log, shares)

    def close(self) -> None:
        self.group.close()
