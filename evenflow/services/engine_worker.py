"""What prefill and decode workers share on top of the worker lifecycle (services/worker.py):
an engine run on its own thread (services/engine_thread.py: typed commands in, typed events
out), its events turned into messages (KV events and snapshots for the index, expert load for
the balancer, profiles for the asking gateway), K/V served to pullers, placements applied, the
requests of gateways that went silent dropped, a periodic stats line, the engine's load in
the heartbeat and the /metrics gauges, and the switch between the two roles in place (the
planner's RoleSwitch: drain, then serve the other role with the same process, engine, weights
and prefix cache)."""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar

from evenflow.engine.config.settings import EngineConfig
from evenflow.proto import errors, subjects
from evenflow.proto.engine_values import EPTopology, RankTiming, ServingForm
from evenflow.proto.messages import (
    Cancel,
    DecodeRequest,
    ErrorMessage,
    ExpertLoad,
    ExpertPlacement,
    FleetTarget,
    KVEvents,
    KVSnapshot,
    KVTransferComplete,
    Message,
    PrefillRequest,
    ProfileRequest,
    ProfileResult,
    Role,
    RoleSwitch,
    WorkerHeartbeat,
)
from evenflow.services.bus import MessageBus
from evenflow.services.config import MeshConfig
from evenflow.services.engine_api import ServingEngine
from evenflow.services.engine_thread import (
    Admitted,
    ApplyPlacement,
    EngineEvent,
    EngineThread,
    ExpertLoadTaken,
    KVEventsTaken,
    KVSnapshotTaken,
    PlacementApplied,
    PrefixExported,
    PrefixImported,
    Profile,
    ProfileTaken,
    Rejected,
    SnapshotKV,
    StepDone,
    StepFailed,
    TakeExpertLoad,
)
from evenflow.services.kv_pull import PullServer
from evenflow.services.metrics import (
    ROLE_SWITCH_MIGRATED,
    ROLE_SWITCH_SECONDS,
    ROLE_SWITCHES,
    VLLM_KV_USAGE,
    VLLM_RUNNING,
    VLLM_WAITING,
    export_kv_disk_counts,
    export_spec_counts,
)
from evenflow.services.supervisor import EXIT_ROLE_SWITCH
from evenflow.services.worker import WorkerService

log = logging.getLogger(__name__)

MAX_PROFILE_STEPS = 1000  # what one POST /admin/profile may ask of a worker
MAX_PROFILE_SECONDS = 300.0

# The per-worker subjects of the two engine roles, by kind (a role class's `handlers` name the
# kinds it serves). A worker that may switch role subscribes to all four from the start, and
# refuses what its current role does not serve (retryable: the gateway tries another worker).
ROLE_SUBJECTS: dict[str, Callable[[str], str]] = {
    "prefill": subjects.prefill_worker, "kv_pulled": subjects.kv_pulled,
    "decode": subjects.decode_worker, "kv_transfer": subjects.kv_transfer}
# Each role's worker class, by name, not imported: services/ sits below the role packages
# (DESIGN's import rules), and a switch loads the other role's module when it happens.
ROLE_CLASSES = {Role.PREFILL: "evenflow.prefill.service:PrefillWorker",
                Role.DECODE: "evenflow.decode.service:DecodeWorker"}


class EngineWorker(WorkerService):
    handlers: ClassVar[dict[str, str]] = {}  # subject kind (ROLE_SUBJECTS) -> method name

    def __init__(self, config: MeshConfig, worker_id: str, bus: MessageBus | None = None) -> None:
        super().__init__(config, worker_id, bus)
        self.switching_to = ""  # the role a switch under way drains towards
        self.role_switches = 0
        self.requests_finished = 0  # cumulative, in the heartbeat (the planner's request rate)
        self._switch: asyncio.Task | None = None
        self.kv_seq = 0  # KVEvents published so far in this epoch
        self._engine: ServingEngine | None = None
        self._thread: EngineThread | None = None
        self._temporary_kv_disk: str | None = None  # this worker's own KV disk tier, if made
        # for the periodic stats line: since the last one
        self._stat_tokens = self._stat_prompt_tokens = self._stat_cached = 0
        self._stat_prompts_seen = 0
        self._stat_started: set[str] = set()  # requests whose first output was counted
        self._gateways_seen: dict[str, float] = {}  # gateway inbox -> last sign of life
        self._kv_disk_seen: dict[str, int] = {}  # the disk tier's counts at their last export
        self._spec_seen: dict[str, int] = {}  # speculative decoding's, likewise
        self._profiles: dict[str, str] = {}  # profile request id -> the asking gateway's inbox
        self.decode_seen: dict[str, float] = {}  # decode worker -> its last heartbeat (monotonic)
        self._born = time.monotonic()
        # the planner's latest FleetTarget (mode scale) and when it came (monotonic)
        self._fleet_target: tuple[FleetTarget, float] | None = None

    # -- the worker lifecycle's hooks -------------------------------------------------------
    def heartbeat(self) -> WorkerHeartbeat:
        """The heartbeat with the engine's load, speed and serving form."""
        thread = self._thread
        form = thread.serving_form if thread else ServingForm()
        return WorkerHeartbeat(worker_id=self.worker_id, role=self.role,
                               model=self.config.model_name, sent_at=time.time(),
                               epoch=self.epoch, draining=self.draining,
                               unhealthy=self.healthy() or "",
                               metrics_port=self.config.metrics_port,
                               step_seconds=thread.step_seconds if thread else 0.0,
                               prompt_tokens_computed=thread.prompt_tokens_computed
                               if thread else 0,
                               output_tokens=thread.output_tokens if thread else 0,
                               stream_seconds=thread.stream_seconds if thread else 0.0,
                               stream_tokens=thread.stream_tokens if thread else 0,
                               weights=form.weights, kv_cache_dtype=form.kv_cache,
                               kernels=form.kernels, numerics=form.numerics,
                               switching_to=self.switching_to,
                               role_switches=self.role_switches,
                               requests_finished=self.requests_finished,
                               reconnects=self.bus.reconnects)

    def healthy(self) -> str | None:
        """An engine whose steps keep failing makes its worker unhealthy."""
        return self._thread.problem if self._thread is not None else None

    def ready_note(self) -> str:
        return f" ({self._engine.kernels.summary()})" if self._engine is not None else ""

    def before_beat(self) -> None:
        self._export_engine_gauges()

    async def stop_parts(self) -> None:
        await super().stop_parts()
        if self._thread is not None:
            self._thread.stop()
        if self._temporary_kv_disk is not None:
            shutil.rmtree(self._temporary_kv_disk, ignore_errors=True)

    # -- hooks for prefill and decode -------------------------------------------------------
    def on_outputs(self, outputs: StepDone) -> None:
        """A step's outputs (engine workers)."""

    def on_admitted(self, event: Admitted) -> None:
        """The engine took a request."""

    def on_rejected(self, event: Rejected) -> None:
        """The engine refused a request (its reason names the problem)."""

    def on_step_failed(self, event: StepFailed) -> None:
        """A step raised and the engine dropped these requests."""

    def on_prefix_imported(self, event: PrefixImported) -> None:
        """Pulled K/V went into the prefix cache (prefill workers)."""

    def take_role(self) -> None:
        """This role's own state, fresh: at start, and after a switch into it."""

    def leave_role(self) -> None:
        """Stop this role's own tasks: at shutdown, and on a switch out of it (drained)."""

    def hand_back(self) -> int:
        """A switch's drain bound passed: abort what this role still holds and tell each
        request's gateway to retry it elsewhere (retryable, what was streamed kept); how many."""
        return 0

    # -- role switching ---------------------------------------------------------------------
    def draining_code(self) -> str:
        """The error a draining worker refuses new work with: DRAINING takes it out of the
        gateways' routing for this epoch; a worker draining for a switch comes back under a new
        one, which a late refusal must not take out."""
        return errors.ROLE_SWITCHED if self.switching_to else errors.DRAINING

    async def subscribe_role_subjects(self) -> None:
        """This role's request subjects; with role switching on, the other role's too (each
        message is served by whichever role the worker has when it comes)."""
        kinds = ROLE_SUBJECTS if self.config.role_switching else self.handlers
        for kind in kinds:
            await self.bus.subscribe(ROLE_SUBJECTS[kind](self.worker_id),
                                     functools.partial(self._route, kind))
        await self.bus.subscribe(subjects.control(self.worker_id), self._on_control)

    def _route(self, kind: str, message: Message, ctx: Any) -> None:
        name = type(self).handlers.get(kind)
        if name is not None:
            getattr(self, name)(message, ctx)
        else:  # the other role's request, sent before the gateway heard of a switch
            self._refuse_for_role(message)

    def _refuse_for_role(self, message: Message) -> None:
        if isinstance(message, PrefillRequest | DecodeRequest | KVTransferComplete):
            self.send(message.reply_subject, ErrorMessage(
                request_id=message.request_id, code=errors.ROLE_SWITCHED,
                description=f"worker {self.worker_id} serves {self.role} now", retryable=True,
                worker_id=self.worker_id))
        elif isinstance(message, ProfileRequest):
            self.start_profile(message)
        elif not isinstance(message, Cancel):
            log.debug("%s: not for a %s worker, dropped", type(message).__name__, self.role)

    def _on_control(self, message: Message, _ctx: Any) -> None:
        if not isinstance(message, RoleSwitch) or message.worker_id != self.worker_id:
            return
        try:
            to = Role(message.to_role)
        except ValueError:
            to = None
        if to not in ROLE_CLASSES:
            log.warning("role switch to %r refused: not an engine role", message.to_role)
        elif not self.config.role_switching:
            log.warning("role switch to %s refused: role switching is off here "
                        "(EVENFLOW_ROLE_SWITCHING=1, or `evenflow up --planner`)", to)
        elif self._switch is not None and not self._switch.done():
            log.info("role switch to %s ignored: a switch to %s is under way", to,
                     self.switching_to)
        elif to is not self.role and not self.draining:
            self._switch = asyncio.create_task(
                self.switch_role(to, message.drain_s, message.reason, message.in_place),
                name="role switch")
            self._owned_tasks.append(self._switch)

    async def switch_role(self, to: Role, drain_s: float, reason: str = "",
                          in_place: bool = True) -> None:
        """Drain this role (nothing new routed here; what runs finishes within drain_s, the
        rest is handed back to be retried elsewhere), then serve `to` with the same process,
        engine and weights. The prefix cache stays: it is announced again under a new epoch
        (the gateways see a new generation of this worker, in its new role, at once).
        Not in place: drained, the process exits with EXIT_ROLE_SWITCH, and the launcher
        starts it again as `to` (weights loaded again, the prefix cache lost)."""
        start, was = time.monotonic(), self.role
        log.info("%s %s: %s to %s%s", was, self.worker_id,
                 "switching" if in_place else "restarting", to,
                 f" ({reason})" if reason else "")
        self.draining, self.switching_to = True, str(to)
        await self._beat(timeout_s=1)  # routing stops now, not at the next beat
        deadline = start + max(0.0, drain_s)
        while self.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        handed_back = self.hand_back() if self.busy() else 0
        ROLE_SWITCH_MIGRATED.inc(handed_back)
        if not in_place:
            log.info("%s %s: drained (%d requests handed back); exiting to be started as %s",
                     was, self.worker_id, handed_back, to)
            self.exit_code = EXIT_ROLE_SWITCH
            self.request_stop()
            return
        self.leave_role()
        module, _, name = ROLE_CLASSES[to].partition(":")
        # The role is the object's class: both classes are EngineWorkers over the same state
        # (engine, engine thread, bus, subscriptions); the new one adds its own (take_role).
        self.__class__ = getattr(importlib.import_module(module), name)
        self.epoch, self.kv_seq = uuid.uuid4().hex[:12], 0
        self.take_role()
        self.role_switches += 1
        self.draining, self.switching_to = False, ""
        self.engine_thread.submit(SnapshotKV())  # the index learns its blocks anew
        await self._beat(timeout_s=1)
        seconds = time.monotonic() - start
        ROLE_SWITCHES.labels(str(was), str(to)).inc()
        ROLE_SWITCH_SECONDS.observe(seconds)
        log.info("%s %s: now serving %s (switch took %.2f s; %d requests handed back)", was,
                 self.worker_id, to, seconds, handed_back)

    # -- the engine -------------------------------------------------------------------------
    @property
    def engine(self) -> ServingEngine:
        assert self._engine is not None, "serve_engine first"
        return self._engine

    @property
    def engine_thread(self) -> EngineThread:
        assert self._thread is not None, "serve_engine first"
        return self._thread

    def engine_config(self) -> EngineConfig:
        """The mesh's engine settings for this worker, with its KV disk tier's directory:
        kv_disk_dir/<worker id> (persistent), or a temporary one removed when it exits."""
        if self.config.kv_disk_gb <= 0:
            return self.config.engine_config()
        if self.config.kv_disk_dir:
            return self.config.engine_config(os.path.join(self.config.kv_disk_dir,
                                                          self.worker_id))
        self._temporary_kv_disk = tempfile.mkdtemp(prefix=f"evenflow-kv-disk-{self.worker_id}-")
        return self.config.engine_config(self._temporary_kv_disk)

    def engine_build_args(self) -> dict[str, Any]:
        """evenflow.engine.build_engine's arguments for this worker (prefill and decode
        workers' start()): its kind, settings and switches, and a DEP rank's place."""
        self.config.apply_engine_switches()
        config = self.config
        return {"kind": config.engine, "config": self.engine_config(),
                "collect_kv_events": True, "ep_rank": config.ep_rank,
                "ep_group": config.ep_group, "mock_timing_scale": config.mock_timing_scale,
                "mock_profile": config.mock_profile}

    async def serve_engine(self, engine: ServingEngine) -> None:
        """Run `engine` on its own thread, drain its events, answer the KV index's resync
        requests and, for MoE engines under a placement, the balancer."""
        self._engine = engine
        self._thread = EngineThread(engine, asyncio.get_running_loop(),
                                    step_delay_s=self.config.step_delay_s(self.worker_id))
        self._thread.start()
        self._owned_tasks.append(asyncio.create_task(self._drain_engine_events(),
                                                     name="engine events"))
        await self.bus.subscribe(subjects.kv_resync(self.worker_id), self._on_resync)
        self.pull_server = PullServer(self.send, self._thread.submit, self.worker_id,
                                      self.config.kv_chunk_bytes)
        await self.bus.subscribe(subjects.kv_pull(self.worker_id), self.pull_server.on_request)
        await self.bus.subscribe(subjects.heartbeat(Role.GATEWAY, "*"),
                                 self._on_gateway_heartbeat)
        await self.bus.subscribe(subjects.heartbeat(Role.DECODE, "*"), self._on_decode_heartbeat)
        await self.bus.subscribe(subjects.FLEET_TARGET, self._on_fleet_target)
        self._owned_tasks.append(asyncio.create_task(self._sweep_orphans(), name="orphans"))
        if self.config.stats_log_interval_s > 0:
            self._owned_tasks.append(asyncio.create_task(self._log_stats(), name="stats"))
        if engine.placement.active:
            await self.bus.subscribe(subjects.EXPERT_PLACEMENT, self._on_placement)
            self._owned_tasks.append(asyncio.create_task(self._report_expert_load(),
                                                         name="eplb"))

    async def _drain_engine_events(self) -> None:
        events = self.engine_thread.events
        while True:
            event: EngineEvent = await events.get()
            try:
                self._on_engine_event(event)
            except Exception:  # one bad event must not stop the drain
                log.exception("handling %s failed", type(event).__name__)

    async def _log_stats(self) -> None:
        """A periodic stats line: throughput, queue, KV use (only when something happened)."""
        interval = self.config.stats_log_interval_s
        while True:
            await asyncio.sleep(interval)
            engine, tokens, prompts = self.engine, self._stat_tokens, self._stat_prompt_tokens
            self._stat_tokens = self._stat_prompt_tokens = 0
            if not (tokens or prompts or engine.num_running or engine.num_waiting):
                continue
            used = 1 - engine.num_free_kv_blocks / max(1, engine.layout.num_kv_blocks)
            log.info("stats: %.1f output tok/s, %.1f prompt tok/s, %d running, %d waiting, "
                     "KV cache %.1f%% used, %d%% of prompt tokens cached", tokens / interval,
                     prompts / interval, engine.num_running, engine.num_waiting, 100 * used,
                     round(100 * self._stat_cached / max(1, self._stat_prompts_seen)))
            self._stat_cached = self._stat_prompts_seen = 0

    def _count_outputs(self, event: StepDone) -> None:
        for out in event.outputs:
            self._stat_tokens += len(out.new_token_ids)
            if out.new_token_ids and out.num_prompt_tokens and out.request_id not in \
                    self._stat_started:
                self._stat_started.add(out.request_id)
                self._stat_prompt_tokens += out.num_prompt_tokens
                self._stat_prompts_seen += out.num_prompt_tokens
                self._stat_cached += out.num_cached_tokens
            if out.finished:
                self._stat_started.discard(out.request_id)
                if out.kv is None:  # (a prefill's K/V export follows its finished output)
                    self.requests_finished += 1

    def _on_engine_event(self, event: EngineEvent) -> None:
        match event:
            case StepDone():
                self._count_outputs(event)
                self.on_outputs(event)
            case Admitted():
                self.on_admitted(event)
            case Rejected():
                self.on_rejected(event)
            case StepFailed(request_ids, reason):
                log.error("engine step failed (%s); %d requests failed", reason,
                          len(request_ids))
                self.on_step_failed(event)
            case KVEventsTaken(events):
                self.kv_seq += 1
                self.send(subjects.KV_EVENTS, KVEvents(
                    worker_id=self.worker_id, role=self.role, epoch=self.epoch,
                    seq=self.kv_seq, events=events))
            case KVSnapshotTaken(hashes, disk_hashes):
                self.send(subjects.KV_EVENTS, KVSnapshot(
                    worker_id=self.worker_id, role=self.role, epoch=self.epoch,
                    seq=self.kv_seq, block_hashes=hashes, disk_block_hashes=disk_hashes))
            case ExpertLoadTaken(version, load, timing, topology):
                t, place = timing or RankTiming(), topology or EPTopology()
                self.send(subjects.EXPERT_LOAD, ExpertLoad(
                    worker_id=self.worker_id, version=version, num_layers=load.num_layers,
                    num_slots=load.num_slots, counts=load.counts, role=self.role.value,
                    group=self.config.ep_group, steps=t.steps, step_s=t.step_s,
                    moe_compute_s=t.moe_compute_s, moe_wait_s=t.moe_wait_s, moe_rows=t.rows,
                    ep_rank=place.rank, ep_size=place.group_size, host=place.host))
                if t.steps:
                    self._record_rank_sample(t.steps, t.step_s, t.moe_compute_s, t.moe_wait_s,
                                             t.rows)
            case ProfileTaken(request_id, steps, lines, trace_file, error):
                reply = self._profiles.pop(request_id, None)
                if reply is not None:
                    self.send(reply, ProfileResult(
                        request_id=request_id, worker_id=self.worker_id, steps=steps,
                        lines=lines, trace_file=trace_file, error=error))
            case PrefixExported():
                self.pull_server.on_exported(event)
            case PrefixImported():
                self.on_prefix_imported(event)
            case PlacementApplied(version, seconds, error):
                if error is None:
                    log.info("placement %d applied in %.1f ms", version, seconds * 1e3)
                else:
                    log.warning("placement %d not applied: %s", version, error)

    # -- operator profiles (POST /admin/profile at the gateway) ----------------------------
    def start_profile(self, request: ProfileRequest) -> None:
        """Profile this worker's next steps; the result goes back to the asking gateway."""
        if not self.config.profile_dir:
            self.send(request.reply_subject, ProfileResult(
                request_id=request.request_id, worker_id=self.worker_id, steps=0,
                error="profiling is off on this worker (EVENFLOW_PROFILE_DIR is not set)"))
            return
        os.makedirs(self.config.profile_dir, exist_ok=True)
        trace = os.path.join(self.config.profile_dir,
                             f"{self.worker_id}-{int(time.time() * 1e3)}.trace.json")
        self._profiles[request.request_id] = request.reply_subject
        steps = max(1, min(request.steps, MAX_PROFILE_STEPS))
        timeout = max(0.1, min(request.timeout_s, MAX_PROFILE_SECONDS))
        self.engine_thread.submit(Profile(request.request_id, steps, timeout, trace))

    # -- the planner's sizes, for an autoscaler (Ray Serve) ----------------------------------
    def _on_fleet_target(self, message: Message, _ctx: object) -> None:
        if isinstance(message, FleetTarget):
            self._fleet_target = (message, time.monotonic())

    def load_stats(self) -> dict[str, float]:
        """This role's load signal (the autoscaling policy's when no planner sizes it)."""
        return {}

    def autoscaling_stats(self) -> dict[str, float]:
        """The load signal, and `planner_target`: the workers the planner's latest FleetTarget
        wants in this role, while it is fresh (rayserve/autoscaling.py follows it)."""
        stats = self.load_stats()
        if self._fleet_target is not None:
            target, at = self._fleet_target
            if time.monotonic() - at <= max(30.0, 4 * self.config.planner_interval_s):
                stats["planner_target"] = float(
                    target.prefill if self.role is Role.PREFILL else target.decode)
        return stats

    # -- orphans: requests of a gateway that died ---------------------------------------------
    def gateway_alive(self, reply_subject: str) -> None:
        """A sign of life from the gateway behind reply_subject (a heartbeat or a request)."""
        self._gateways_seen[reply_subject] = time.monotonic()

    def _on_decode_heartbeat(self, message: Message, _ctx: object) -> None:
        if isinstance(message, WorkerHeartbeat) and message.role is Role.DECODE \
                and not message.draining:
            self.decode_seen[message.worker_id] = time.monotonic()

    def decode_alive(self, worker_id: str) -> bool:
        """Whether `worker_id` heartbeats as a decode worker (or this worker started too
        recently to have heard every one)."""
        now, timeout = time.monotonic(), self.config.worker_timeout_s
        seen = self.decode_seen.get(worker_id)
        return (seen is not None and now - seen <= timeout) or now - self._born < 2 * timeout

    def _on_gateway_heartbeat(self, message: Message, _ctx: object) -> None:
        if isinstance(message, WorkerHeartbeat) and message.role is Role.GATEWAY:
            self.gateway_alive(subjects.gateway_inbox(message.worker_id))

    async def _sweep_orphans(self) -> None:
        ttl = self.config.orphan_ttl_s
        while True:
            await asyncio.sleep(min(1.0, ttl / 2))
            cutoff = time.monotonic() - ttl
            gone = {s for s, seen in self._gateways_seen.items() if seen < cutoff}
            if gone:
                for subject in gone:
                    del self._gateways_seen[subject]
                dropped = self.drop_requests_of(gone)
                if dropped:
                    log.warning("dropped %d requests of %d silent gateways", dropped, len(gone))

    def drop_requests_of(self, reply_subjects: set[str]) -> int:
        """Abort every request whose gateway is gone; how many (engine workers)."""
        return 0

    # -- expert placement -------------------------------------------------------------------
    def _on_placement(self, message: Message, _ctx: object) -> None:
        if not isinstance(message, ExpertPlacement) or message.role not in ("", self.role.value):
            return  # another role's placement
        if message.version == self.engine.placement.version:
            return  # a periodic re-announcement of what we run
        self.engine_thread.submit(ApplyPlacement(message.version, message.phy2log,
                                                 message.shares))

    def _record_rank_sample(self, steps: int, step_s: float, compute_s: float, wait_s: float,
                            rows: int) -> None:
        """An expert-parallel rank's steps since its last load report, as one span's
        attributes (a sample per report, not a span per step)."""
        self.tracer.start_span("ep.rank_steps", attributes={
            "evenflow.ep.group": self.config.ep_group, "evenflow.ep.rank": self.config.ep_rank,
            "evenflow.ep.steps": steps, "evenflow.ep.step_ms": step_s / steps * 1e3,
            "evenflow.ep.moe_compute_ms": compute_s / steps * 1e3,
            "evenflow.ep.moe_wait_ms": wait_s / steps * 1e3,
            "evenflow.ep.rows_per_step": rows / steps}).end()

    async def _report_expert_load(self) -> None:
        while True:
            await asyncio.sleep(self.config.eplb_report_interval_s)
            self.engine_thread.submit(TakeExpertLoad())

    def _on_resync(self, _message: Message, _ctx: object) -> None:
        self.engine_thread.submit(SnapshotKV())

    def _export_engine_gauges(self) -> None:
        engine, model = self._engine, self.config.model_name
        if engine is None:
            return
        VLLM_RUNNING.labels(model).set(engine.num_running)
        VLLM_WAITING.labels(model).set(engine.num_waiting)
        VLLM_KV_USAGE.labels(model).set(
            1 - engine.num_free_kv_blocks / max(1, engine.layout.num_kv_blocks))
        disk = engine.prefix.disk_counts
        if disk is not None:
            export_kv_disk_counts(disk, self._kv_disk_seen)
        if engine.spec_counts is not None:
            export_spec_counts(engine.spec_counts, model, self._spec_seen)
