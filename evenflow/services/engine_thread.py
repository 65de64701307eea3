"""Runs a serving engine on a dedicated thread so forward passes never block the event loop.

Work crosses in both directions as named messages: the loop puts `EngineCommand`s on one
thread-safe queue; the thread applies them between steps (so they never race a step), steps the
engine while it has work, and puts `EngineEvent`s on one asyncio queue that a single task per
worker drains (`EngineWorker._drain_engine_events`). No closures cross.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from evenflow.proto.engine_values import EPTopology, ExpertLoadCounts, RankTiming
from evenflow.proto.kv_handoff import KVPayload
from evenflow.proto.messages import KVCacheEvent
from evenflow.proto.sampling import SamplingParams
from evenflow.services import logs
from evenflow.services.engine_api import EngineOutput, ServingEngine
from evenflow.services.supervisor import EXIT_PLANNED_RESTART

log = logging.getLogger(__name__)


# -- commands: event loop -> engine thread ------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    export_kv: bool = False


@dataclass(frozen=True)
class AddPrefilled:
    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    sampling: SamplingParams
    kv: KVPayload
    num_cached_tokens: int


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class ApplyPlacement:
    version: int
    phy2log: list[int]
    shares: list[float]


@dataclass(frozen=True)
class TakeExpertLoad:
    pass


@dataclass(frozen=True)
class SnapshotKV:
    pass


@dataclass(frozen=True)
class Profile:
    """Profile the next `steps` steps (or until timeout_s), then emit ProfileTaken."""

    request_id: str
    steps: int
    timeout_s: float
    trace_file: str


@dataclass(frozen=True)
class ExportPrefix:
    """A KV pull to answer (services/kv_pull.py): the prompt's cached blocks from first_block."""

    request_id: str
    prompt_token_ids: list[int]
    first_block: int
    reply_subject: str
    nonce: str = ""  # the pull's, carried back in every answer


@dataclass(frozen=True)
class ImportPrefix:
    """Pulled blocks into the prefix cache, before the request that wanted them is added."""

    request_id: str
    prompt_token_ids: list[int]
    first_block: int
    kv: KVPayload


EngineCommand = (AddRequest | AddPrefilled | Abort | ApplyPlacement | TakeExpertLoad
                 | SnapshotKV | Profile | ExportPrefix | ImportPrefix)


# -- events: engine thread -> event loop --------------------------------------------------------
@dataclass(frozen=True)
class Admitted:
    request_id: str
    # When the engine thread took it (time.time_ns()): the end of the request's queue span. The
    # event loop sees the event later (by a few ms while the engine thread, already computing,
    # holds the GIL), so the loop's own clock would count compute time as queue time.
    at_ns: int


def first_token_times(received_ns: int, admitted_ns: int) -> tuple[float, float]:
    """A request's first token, now: (seconds from its worker receiving it to its engine
    taking it, seconds from then to now) — TokenDelta.queued_s / computed_s. admitted_ns 0: not
    seen taken (counted as taken on arrival)."""
    admitted = admitted_ns or received_ns
    return (admitted - received_ns) / 1e9, (time.time_ns() - admitted) / 1e9


@dataclass(frozen=True)
class Rejected:
    request_id: str
    reason: str


@dataclass(frozen=True)
class StepDone:
    outputs: Sequence[EngineOutput]


@dataclass(frozen=True)
class StepFailed:
    """A step raised: every request the engine held was dropped (their blocks freed)."""

    request_ids: list[str]
    reason: str


@dataclass(frozen=True)
class KVEventsTaken:
    events: list[KVCacheEvent]


@dataclass(frozen=True)
class KVSnapshotTaken:
    block_hashes: list[int]
    disk_block_hashes: list[int]


@dataclass(frozen=True)
class ExpertLoadTaken:
    version: int
    load: ExpertLoadCounts
    timing: RankTiming | None = None  # an expert-parallel rank's (ServingEngine)
    topology: EPTopology | None = None


@dataclass(frozen=True)
class PlacementApplied:
    version: int
    seconds: float
    error: str | None = None  # why it was not applied


@dataclass(frozen=True)
class ProfileTaken:
    request_id: str
    steps: int
    lines: list[str]
    trace_file: str
    error: str = ""


@dataclass(frozen=True)
class PrefixExported:
    request_id: str
    reply_subject: str
    first_block: int
    kv: KVPayload | None  # None: it failed (error says why)
    error: str = ""
    nonce: str = ""


@dataclass(frozen=True)
class PrefixImported:
    request_id: str
    num_blocks: int  # blocks written into the cache
    error: str = ""  # why none were


EngineEvent = (Admitted | Rejected | StepDone | StepFailed | KVEventsTaken | KVSnapshotTaken
               | ExpertLoadTaken | PlacementApplied | ProfileTaken | PrefixExported
               | PrefixImported)

MAX_CONSECUTIVE_STEP_FAILURES = 3  # then the engine reports itself unhealthy
EXIT_ENGINE_LOST = 70  # the worker's exit status when its engine can never step again
# A busy engine's KV events (blocks stored / removed) go out together at most this often, not
# after every step: at batch 16 a decode step fills about one block, and a message per step
# meant one more publish, NATS delivery and Redis pipeline per step for the worker, NATS and the
# KV indexer, on CPUs the decode step shares. An idle engine flushes at once, so an index never
# lags a finished prefill.
KV_EVENTS_INTERVAL_S = 0.05
# Steps this close after the previous one ran back to back (the engine busy throughout): the
# time between them — applying commands, flushing events, a process stopped from outside — is
# counted as step time (heartbeats' step_seconds: what a token cost this worker in wall time)
BACK_TO_BACK_S = 0.25
# How often an idle engine serving on torch's kernels looks for the native ones' finished build
KERNEL_CHECK_S = 1.0


def exit_worker(reason: str, planned: bool = False) -> None:
    """An engine that lost a part of itself (a tensor-parallel rank) cannot be repaired in
    place: the worker process ends, its heartbeats stop, the gateway moves its streams as for
    any dead worker and the supervisor starts a new one. planned: a restart the engine asked
    for (EXIT_PLANNED_RESTART: the supervisor restarts it at once, not counted as a crash)."""
    code = EXIT_PLANNED_RESTART if planned else EXIT_ENGINE_LOST
    if planned:
        log.warning("%s; the worker restarts (status %d)", reason, code)
    else:
        log.critical("engine lost: %s; the worker exits (status %d)", reason, code)
    logs.drain()
    logging.shutdown()
    os._exit(code)


class EngineThread:
    def __init__(self, engine: ServingEngine, loop: asyncio.AbstractEventLoop,
                 on_fatal: Callable[[str, bool], None] = exit_worker, step_delay_s: float = 0.0
                 ) -> None:
        self.engine, self._loop, self._on_fatal = engine, loop, on_fatal
        self.step_delay_s = step_delay_s  # a straggler on purpose (debug_step_delay_ms)
        self.events: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self._commands: queue.SimpleQueue[EngineCommand | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.consecutive_failures = 0
        self.problem: str | None = None  # why this engine cannot serve (None: it can)
        self._profile: Profile | None = None  # running: steps counted, ends at a deadline
        self._profile_steps, self._profile_until = 0, 0.0
        self._kv_flush_at = 0.0  # while stepping, KV events go out at most this often
        # cumulative, for heartbeats (written here, read by the worker's loop)
        self.step_seconds = 0.0
        self.prompt_tokens_computed = 0
        self.output_tokens = 0
        # finished requests' time from their first token to their last, and those tokens: a
        # worker's time per output token as its streams saw it (a slow worker's batches grow,
        # so its step time per token hides it; this does not)
        self.stream_seconds = 0.0
        self.stream_tokens = 0
        self._started: dict[str, list[float]] = {}  # request -> [first token at, tokens since]
        self._imported: set[str] = set()  # requests whose prompt came computed (K/V imported)
        self._last_step_end = 0.0
        self._kernels_checked_at = 0.0
        self._kernels_pending = engine.kernels.pending  # (checked while idle until it is not)
        # (weights, KV cache dtype, kernels), read by heartbeats; rewritten here on a switch
        self.serving_form = engine.kernels.serving_form()

    def start(self) -> None:
        self._thread.start()

    def submit(self, command: EngineCommand) -> None:
        """Apply `command` on the engine thread before the next step."""
        self._commands.put(command)

    def stop(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=10)

    def _emit(self, event: EngineEvent) -> None:
        self._loop.call_soon_threadsafe(self.events.put_nowait, event)

    def _apply(self, command: EngineCommand) -> None:
        engine = self.engine
        match command:
            case AddRequest(request_id, prompt, sampling, export_kv):
                self._admit(request_id, lambda: engine.add_request(
                    request_id, prompt, sampling, export_kv))
            case AddPrefilled(request_id, prompt, first, sampling, kv, cached):
                self._imported.add(request_id)
                self._admit(request_id, lambda: engine.add_prefilled_request(
                    request_id, prompt, first, sampling, kv, cached))
            case Abort(request_id):
                engine.abort(request_id)
            case ApplyPlacement(version, phy2log, shares):
                started = time.monotonic()
                try:
                    engine.placement.apply_expert_placement(version, phy2log, shares)
                except (AssertionError, RuntimeError, ValueError) as exc:
                    self._emit(PlacementApplied(version, 0.0, str(exc) or type(exc).__name__))
                else:
                    self._emit(PlacementApplied(version, time.monotonic() - started))
            case TakeExpertLoad():
                placement = engine.placement
                self._emit(ExpertLoadTaken(placement.version, placement.take_expert_load(),
                                           placement.take_rank_timing(),
                                           placement.ep_topology()))
            case SnapshotKV():
                self._flush_kv_events()  # the snapshot's sequence number covers these
                self._emit(KVSnapshotTaken(engine.prefix.cached_block_hashes(),
                                               engine.prefix.disk_block_hashes()))
            case ExportPrefix(request_id, prompt, first_block, reply_subject, nonce):
                try:
                    kv = engine.prefix.export_prefix(prompt, first_block)
                except Exception as exc:  # a bad request must not stop the engine
                    self._emit(PrefixExported(request_id, reply_subject, first_block, None,
                                              _reason(exc), nonce))
                else:
                    self._emit(PrefixExported(request_id, reply_subject, first_block, kv,
                                              nonce=nonce))
            case ImportPrefix(request_id, prompt, first_block, kv):
                try:
                    written = engine.prefix.import_prefix(prompt, first_block, kv)
                except Exception as exc:
                    self._emit(PrefixImported(request_id, 0, _reason(exc)))
                else:
                    self._emit(PrefixImported(request_id, written))
            case Profile(request_id, _, timeout_s, trace_file):
                if self._profile is not None:
                    self._emit(ProfileTaken(request_id, 0, [], trace_file,
                                            "a profile is already running on this worker"))
                    return
                engine.profile.start()
                self._profile, self._profile_steps = command, 0
                self._profile_until = time.monotonic() + timeout_s

    def _maybe_end_profile(self) -> None:
        """After a step or an idle wait: the profile's steps are done or its time is up."""
        profile = self._profile
        if profile is None or (self._profile_steps < profile.steps
                               and time.monotonic() < self._profile_until):
            return
        self._profile = None
        try:
            lines = self.engine.profile.stop(self._profile_steps, profile.trace_file)
        except Exception as exc:  # a failed export must not stop the engine
            log.exception("profile failed")
            self._emit(ProfileTaken(profile.request_id, self._profile_steps, [], "",
                                    _reason(exc)))
            return
        self._emit(ProfileTaken(profile.request_id, self._profile_steps, lines,
                                profile.trace_file))

    def _admit(self, request_id: str, add: Callable[[], None]) -> None:
        """Admitted, or Rejected with the reason: any failure refuses this request only."""
        try:
            add()
        except Exception as exc:
            self._emit(Rejected(request_id, _reason(exc)))
        else:
            self._emit(Admitted(request_id, time.time_ns()))

    def _flush_kv_events(self) -> None:
        events = self.engine.prefix.take_kv_events()
        if events:
            self._emit(KVEventsTaken(events))

    def _run(self) -> None:
        self.engine.configure_current_thread()
        while True:
            # Idle: wait for work. Busy: take whatever is queued without waiting, then step.
            commands: list[EngineCommand | None] = []
            try:
                if self.engine.has_unfinished():
                    commands.append(self._commands.get_nowait())
                else:
                    commands.append(self._commands.get(timeout=self.engine.idle_poll_s))
                while True:
                    commands.append(self._commands.get_nowait())
            except queue.Empty:
                pass
            for command in commands:
                if command is None:
                    return
                try:
                    self._apply(command)
                except Exception:  # a bug in one command must not stop the engine
                    log.exception("engine command %s failed", type(command).__name__)
            if self._kernels_pending and not self.engine.has_unfinished():
                self._maybe_switch_kernels()
            if self.engine.decide_step():  # (once per loop: a collective for DEP ranks)
                self._step()
                if self._profile is not None:
                    self._profile_steps += 1
            self._maybe_end_profile()
            now = time.monotonic()
            if not self.engine.has_unfinished() or now >= self._kv_flush_at:
                self._kv_flush_at = now + KV_EVENTS_INTERVAL_S
                self._flush_kv_events()
            if self.engine.fatal_error is not None:
                self._on_fatal(self.engine.fatal_error, self.engine.restart_planned)
                return

    def _maybe_switch_kernels(self) -> None:
        """Idle: take the native kernels if they were built since this engine started (requests
        arriving meanwhile wait in the queue, none is lost)."""
        now = time.monotonic()
        if now < self._kernels_checked_at + KERNEL_CHECK_S:
            return
        self._kernels_checked_at = now
        try:
            summary = self.engine.kernels.switch_when_ready()
        except Exception:  # torch's kernels keep serving what the engine still holds
            log.exception("switching to the native kernels failed")
            self._kernels_pending = False
            return
        self._kernels_pending = self.engine.kernels.pending
        if not self._kernels_pending:  # switched, or the build failed: torch's kernels stay
            self.serving_form = self.engine.kernels.serving_form()
        if summary is not None:
            log.info("switched to the native kernels in %.1f s (%s)",
                     time.monotonic() - now, summary)

    def _step(self) -> None:
        """One step. A step that raises fails the requests it held, never the next step: they
        are dropped and reported, and the engine goes on; several failures in a row mark it
        unhealthy (heartbeats say so, and the router stops sending here)."""
        started = time.perf_counter()
        if started - self._last_step_end < BACK_TO_BACK_S:
            started = self._last_step_end  # busy throughout: the gap is this step's too
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed")
            self.consecutive_failures += 1
            try:
                dropped = self.engine.abort_all()
            except Exception:  # nothing more we can do: the worker is unhealthy
                log.exception("engine could not drop its requests")
                dropped, self.consecutive_failures = [], MAX_CONSECUTIVE_STEP_FAILURES
            if self.consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                self.problem = (f"engine step failed {self.consecutive_failures} times in a "
                                f"row: {_reason(exc)}")
            self._emit(StepFailed(dropped, _reason(exc)))
            return
        self.consecutive_failures, self.problem = 0, None
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        self._last_step_end = time.perf_counter()
        self.step_seconds += self._last_step_end - started
        now = self._last_step_end
        for out in outputs:
            self.output_tokens += len(out.new_token_ids)
            started_at = self._started.get(out.request_id)
            if started_at is None:  # its first output: its prompt was computed (here, unless
                self._started[out.request_id] = [now, 0.0]  # its K/V came from a prefill)
                if out.request_id in self._imported:
                    self._imported.discard(out.request_id)
                else:
                    self.prompt_tokens_computed += out.num_prompt_tokens - out.num_cached_tokens
            else:
                started_at[1] += len(out.new_token_ids)
            if out.finished and not out.kv_follows:
                first, tokens = self._started.pop(out.request_id)
                if tokens:
                    self.stream_seconds += now - first
                    self.stream_tokens += int(tokens)
        if outputs:
            self._emit(StepDone(outputs))


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
