"""The one lockstep protocol of expert parallelism with data-parallel attention (DEP): each
rank is a whole Engine (scheduler, KV cache, sequences) whose MoE layers are expert-parallel
over a shm group with the other ranks, and the ranks meet once per step.

The meeting (`decide_step`, exactly once per loop on every rank) is a small all-gather of
int64[this rank has work, its pending placement version, the bytes of its mail]; when any rank
has mail, a second all-gather carries every rank's `Meeting` (runners/rank_wire.py). Every rank
sees the same answers, so all step (or not) together; a rank without work of its own steps
with a dummy forward pass, so every MoE collective meets. A placement every rank holds begins
at the meeting that finds them all holding it, and one MoE layer of it switches per meeting, so
one per step, on every rank at the same call (each rank reading the experts its slots newly
hold: engine/weights/expert_store.py). has_unfinished() only reads: this rank's work, or the
group's last answer.

Two drivers use it:
- the mesh (`evenflow up --ep N`): each rank is a worker of its own (own NATS subject,
  heartbeats, KV cache and events); its engine thread calls decide_step() with no mail; a
  placement reaches each rank over NATS;
- offline (`LLM(expert_parallel_size=N)`, engine/dep/offline.py): rank 0's mail carries the
  other ranks' new requests, aborts, placements and stop, and theirs carry their last step's
  outputs back.
A collective that fails (a rank died or hangs) makes the engine fatal: a mesh worker exits and
its supervisor restarts it, and the group re-forms.

Across hosts (config.ep_rendezvous set), the group is elastic: its ranks meet through the
rendezvous store (parallel/rendezvous.py) in epochs, over a hierarchical group (shm on each
host, gloo between hosts). The survivors of a lost rank restart and form the next epoch
without it (the engine's ranks are the epoch's members; the placement's slots split over
them); a rank that comes back asks to join, and the group's rank 0, which looks for such
requests about once a second, ends the epoch at the next idle meeting (or after
REGROUP_WAIT_S under load): every rank exits with a planned restart (`restart_planned`) and
the next epoch includes the newcomer. Streams on a restarting worker migrate as for any
worker that ends.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from evenflow.engine.config.families import load_model_config
from evenflow.engine.config.settings import EngineConfig, ModelLoadError
from evenflow.engine.core.block_manager import KVEventListener
from evenflow.engine.model.moe_dispatch import EPTimer
from evenflow.engine.model.placement import check_slots
from evenflow.engine.runners.rank_wire import (
    LOAD_TIMEOUT_S,
    STEP_TIMEOUT_S,
    Meeting,
    encode,
    gather_meetings,
)
from evenflow.engine.serving.engine import Engine, StepOutput
from evenflow.engine.serving.placement_control import ExpertPlacement
from evenflow.engine.weights.loader import model_directory
from evenflow.parallel.group import CollectiveError
from evenflow.parallel.hierarchical import HierarchicalGroup, spanning_group
from evenflow.parallel.rendezvous import Membership, RendezvousError, join
from evenflow.parallel.shm import ShmGroup
from evenflow.proto.engine_values import EPTopology, RankTiming

log = logging.getLogger(__name__)


def slot_bytes_for(config: EngineConfig, hidden_size: int, top_k: int) -> int:
    """A shm slot that holds a full step's dispatch (every token to one rank) in float32."""
    rows = config.max_num_batched_tokens * max(1, top_k)
    return max(4 << 20, -(-(rows * hidden_size * 4 + 4096) // 64) * 64)


class LockstepEngine(Engine):
    # Idle ranks still meet this often to agree whether there is work: every 10 ms, and every
    # 40 ms once the group has been idle for 2 s (a request arriving then waits up to that long
    # for its first step; an idle group costs a few % of a core per rank).
    BUSY_POLL_S, IDLE_POLL_S, IDLE_AFTER_S = 0.01, 0.04, 2.0
    IDLE_NAP_AFTER_S = 0.0002  # waiting for an idle peer: sleep, don't spin
    JOIN_CHECK_S = 1.0  # an elastic group's rank 0 looks for ranks asking to join this often
    REGROUP_WAIT_S = 10.0  # a busy group takes joiners after this long anyway

    def __init__(self, config: EngineConfig, kv_event_listener: KVEventListener | None,
                 collect_kv_events: bool, ep_rank: int, group_name: str,
                 peers_alive: Callable[[], bool] | None = None) -> None:
        cfg = load_model_config(model_directory(config.model))
        if not cfg.is_moe:
            raise ModelLoadError("expert parallelism needs a MoE model")
        world = config.expert_parallel_size
        slot_bytes = slot_bytes_for(config, cfg.hidden_size, cfg.num_experts_per_tok)
        self.membership: Membership | None = None
        self.group: ShmGroup | HierarchicalGroup
        try:
            if config.ep_rendezvous:
                slots = cfg.num_experts + config.num_redundant_experts
                self.membership = join(
                    config.ep_rendezvous, group_name, ep_rank, world,
                    tuple(n for n in range(1, world + 1) if slots % n == 0),
                    config.ep_settle_s, LOAD_TIMEOUT_S)
                self.group = spanning_group(self.membership, slot_bytes, LOAD_TIMEOUT_S)
                # this epoch's members are the ranks: the slots split over them
                config = dataclasses.replace(config, num_ep_ranks=self.membership.size)
                log.info("expert-parallel group %s epoch %d: rank %d of %d (planned rank %d)",
                         group_name, self.membership.epoch, self.membership.rank,
                         self.membership.size, ep_rank)
            else:
                self.group = ShmGroup(group_name, ep_rank, world, timeout_s=LOAD_TIMEOUT_S,
                                      slot_bytes=slot_bytes, peers_alive=peers_alive)
        except (CollectiveError, RendezvousError) as exc:
            raise ModelLoadError(f"expert-parallel group {group_name}: {exc}") from exc
        super().__init__(config, kv_event_listener, collect_kv_events, ep_group=self.group)
        self.group.barrier()  # every rank loaded
        self.group.timeout_s = STEP_TIMEOUT_S
        # a placement this rank holds, not yet agreed: (version, phy2log, share or None)
        self.pending_placement: tuple[int, torch.Tensor, torch.Tensor | None] | None = None
        self.inbox: list[Meeting | None] = []  # every rank's mail at the last meeting, by rank
        self.last_pause_s = 0.0  # switching a placement's layer at the last meeting
        self._fatal: str | None = None
        self._last_busy = time.monotonic()
        self._group_busy = False  # the group's answer at the last decide_step()
        self.ep_timer = EPTimer()  # MoE compute / collective time since the last report
        for layer in self.model.moe_layers():
            layer.ep_timer = self.ep_timer
        self._steps, self._step_s = 0, 0.0
        self.restart_planned = False  # the group ends its epoch to take a rank back
        self._join_checked = time.monotonic()
        self._joiners_since: float | None = None
        self._joiners: list[int] = []  # planned ranks asking to join, as rank 0 last saw

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

    def decide_step(self, mail: Meeting | None = None, patient: bool = False) -> bool:
        """The group's meeting: whether any rank has work (a collective: every rank calls it
        once per loop); every rank's mail lands in `inbox`; a placement every rank holds begins
        here, and one MoE layer of it switches. patient: wait for the others without a time
        limit (an offline follower waiting for rank 0)."""
        if self._fatal is not None:
            return False
        pending = self.pending_placement[0] if self.pending_placement else -1
        data = encode(mail) if mail is not None else b""
        try:
            # (new requests in the mail count as work: they are added right after the meeting)
            work = super().has_unfinished() or (mail is not None and bool(mail.adds))
            every = self.group.all_gather(torch.tensor(
                [int(work), pending, len(data), self._joiners_waiting()], dtype=torch.int64),
                nap_after_s=self.IDLE_NAP_AFTER_S, patient=patient)
            sizes = every[:, 2].tolist()
            self.inbox = gather_meetings(self.group, data, sizes) if max(sizes) else []
        except CollectiveError as exc:
            self._lost(exc)
            return False
        if self.pending_placement and bool((every[:, 1] == pending).all()):
            version, phy2log, share = self.pending_placement
            self.pending_placement = None
            self.placement.begin_placement(phy2log, share, version)
        # every rank calls this equally often: one layer of a placement switches everywhere
        started = time.perf_counter()
        self.placement.advance_placement()
        self.last_pause_s = time.perf_counter() - started
        busy = self._group_busy = bool(every[:, 0].any())
        if busy:
            self._last_busy = time.monotonic()
        if int(every[0, 3]) and (not busy or int(every[0, 3]) > self.REGROUP_WAIT_S):
            self._regroup()
            return False
        return busy

    def _joiners_waiting(self) -> int:
        """On an elastic group's rank 0: 0 when no rank asks to join, else for how long (s,
        at least 1) ranks have been asking; elsewhere 0."""
        m = self.membership
        if m is None or m.rank != 0:
            return 0
        now = time.monotonic()
        if now - self._join_checked >= self.JOIN_CHECK_S:
            self._join_checked = now
            try:
                self._joiners = m.joiners()
            except (RuntimeError, OSError) as exc:  # the store is gone: keep serving
                log.warning("rendezvous store unreachable: %s", exc)
                self._joiners = []
            asking = bool(self._joiners)
            self._joiners_since = (self._joiners_since or now) if asking else None
        return 0 if self._joiners_since is None else max(1, int(now - self._joiners_since))

    def _regroup(self) -> None:
        """End this epoch so that the next includes the ranks asking to join: every rank
        restarts (planned), and the group forms again through the rendezvous."""
        assert self.membership is not None
        if self.membership.rank == 0:
            try:
                self.membership.end_epoch(self._joiners)
            except (RuntimeError, OSError) as exc:
                log.warning("could not end epoch %d: %s", self.membership.epoch, exc)
        self.restart_planned = True
        self._fatal = (f"expert-parallel group regroups: a rank asks to join epoch "
                       f"{self.membership.epoch}")

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

    def _new_placement(self, moe_layers: int, slots: int) -> ExpertPlacement:
        return LockstepPlacement(self, moe_layers, slots)

    def take_timing(self) -> RankTiming:
        """This rank's steps and MoE times since the last call."""
        compute_s, wait_s, rows = self.ep_timer.take()
        timing = RankTiming(self._steps, self._step_s, compute_s, wait_s, int(rows))
        self._steps, self._step_s = 0, 0.0
        return timing

    def close(self) -> None:
        self.group.close()


class LockstepPlacement(ExpertPlacement):
    """A rank's expert placement: one is taken when every rank of the group holds it (the
    group's meeting begins it, one MoE layer switches per meeting: LockstepEngine.decide_step),
    and the rank reports its timing and topology to the balancer."""

    def __init__(self, rank: LockstepEngine, moe_layers: int, slots: int) -> None:
        super().__init__(rank, moe_layers, slots)
        self._rank = rank

    def ep_topology(self) -> EPTopology | None:
        """(this rank in its group, the group's size, its host's id: ranks sharing one share
        it), for the balancer's topology-aware placement."""
        group = self._rank.group
        hosts = getattr(group, "hosts", None)
        host = hosts[group.rank] if hosts else "one-host"
        return EPTopology(group.rank, group.world_size, host)

    def take_rank_timing(self) -> RankTiming | None:
        """This rank's steps and MoE times since the last call."""
        return self._rank.take_timing()

    def apply_expert_placement(self, version: int, phy2log: list[int],
                               shares: list[float]) -> None:
        """Checked now (a bad one raises ValueError: the worker reports it and keeps serving),
        held until every rank of the group has it (see decide_step)."""
        layers, slots = self.slot_counts.shape
        if len(phy2log) != layers * slots or len(shares) != layers * slots:
            raise ValueError(f"placement has {len(phy2log)} slots, this engine {layers}x{slots}")
        self.hold_placement(version, torch.tensor(phy2log).view(layers, slots),
                            torch.tensor(shares, dtype=torch.float32).view(layers, slots))

    def hold_placement(self, version: int, phy2log: torch.Tensor,
                       share: torch.Tensor | None) -> None:
        """A placement (moe_layers, slots) to take once every rank holds it (ValueError: a
        bad one); share None: even shares among an expert's replicas."""
        if tuple(phy2log.shape) != tuple(self.slot_counts.shape):
            raise ValueError(f"placement of shape {tuple(phy2log.shape)}, this engine "
                             f"{tuple(self.slot_counts.shape)}")
        for row in phy2log:
            check_slots(row, self._rank.model_config.num_experts, self.config.num_ep_ranks)
        if version > max(self.version, self.staged_version):
            self._rank.pending_placement = (version, phy2log, share)

