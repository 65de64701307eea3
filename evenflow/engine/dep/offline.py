"""Expert-parallel ranks with data-parallel attention (DEP), offline: `LLM(model=...,
expert_parallel_size=N)`, driven over the one lockstep protocol (engine/dep/lockstep.py).

Each rank is a `LockstepEngine` (scheduler, KV cache, sequences) in its own process, except
rank 0, which lives in the caller's process. Attention is data-parallel: a request lives on one
rank (the one with the fewest live requests when it arrives). MoE layers are expert-parallel:
under the expert placement (num_ep_ranks = N, slots rank-major) each rank computes only its
slots, and tokens travel to them and back by all-to-all (engine/model/moe_dispatch.py).

Each step is one meeting of the group, then a step on every rank (a dummy forward pass where a
rank has nothing to run). Rank 0's mail at the meeting (runners/rank_wire.py `Meeting`) carries
the new requests for each rank, aborts, a placement, a request for the slot counts, or stop;
every other rank's carries its previous step's outputs and MoE timing, so rank 0 hands out a
follower's tokens one meeting after the step that made them. The other ranks wait for the
next meeting patiently (an idle group sleeps, no spin, no time limit while rank 0 lives).

Each rank also times its MoE layers per step (its experts' compute, and the dispatch/combine
collectives including the wait for the slowest rank): `DEPEngine.moe_times`. Each rank keeps
only the experts its slots hold; a placement change moves one MoE layer per step, every rank
reading the experts it newly needs from the checkpoint (engine/weights/expert_store.py).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import uuid
import weakref
from collections import deque
from typing import NamedTuple

import torch

from evenflow.engine.config.families import load_model_config
from evenflow.engine.config.settings import EngineConfig, ModelLoadError
from evenflow.engine.core.sequence import FinishReason
from evenflow.engine.dep.lockstep import LockstepEngine, LockstepPlacement
from evenflow.engine.runners.rank_wire import (
    Meeting,
    Placement,
    RankAdd,
    RankOutput,
    RankStepDone,
    stop_ranks,
)
from evenflow.engine.serving.engine import StepOutput
from evenflow.engine.weights.loader import model_directory
from evenflow.proto.sampling import SamplingParams

MOE_TIMES_KEPT = 100_000


def _rank_output(s: StepOutput) -> RankOutput:
    return RankOutput(
        request_id=s.request_id, new_token_ids=list(s.new_token_ids), finished=s.finished,
        finish_reason=s.finish_reason.value if s.finish_reason else "",
        num_prompt_tokens=s.num_prompt_tokens, num_cached_tokens=s.num_cached_tokens,
        logprobs=s.logprobs, prompt_logprobs=s.prompt_logprobs)


def _step_output(o: RankOutput) -> StepOutput:
    return StepOutput(o.request_id, o.new_token_ids, o.finished,
                      FinishReason(o.finish_reason) if o.finish_reason else None,
                      o.num_prompt_tokens, o.num_cached_tokens,
                      logprobs=o.logprobs, prompt_logprobs=o.prompt_logprobs)


class Mail(NamedTuple):
    """What one rank takes from a meeting's mail."""

    stop: bool
    refused: list[RankOutput]  # requests for this rank that its engine refused
    done: list[RankStepDone]  # the other ranks' previous steps (rank 0 reads them)
    slot_counts: torch.Tensor | None  # every rank's, summed, when rank 0 asked


def take_mail(engine: LockstepEngine, rank: int) -> Mail:
    """Apply this meeting's mail to this rank's engine, in rank order on every rank (a request
    for the slot counts is a collective, so every rank makes it at the same point)."""
    refused: list[RankOutput] = []
    done: list[RankStepDone] = []
    counts = None
    stop = False
    for sender, mail in enumerate(engine.inbox):
        if mail is None:
            continue
        stop = stop or mail.stop
        for request_id in mail.aborts:
            engine.abort(request_id)
        for add in mail.adds:
            if add.rank == rank:
                try:
                    engine.add_request(add.request_id, add.prompt_token_ids, add.sampling)
                except ValueError as exc:
                    refused.append(RankOutput(request_id=add.request_id, refused=str(exc)))
        if mail.placement is not None:
            assert isinstance(engine.placement, LockstepPlacement)
            engine.placement.hold_placement(mail.placement.version, *mail.placement.tensors())
        if mail.take_load:
            counts = engine.group.all_reduce(engine.placement.take_slot_counts())
        if mail.done is not None and sender != rank:
            done.append(mail.done)
    return Mail(stop, refused, done, counts)


def _step_done(engine: LockstepEngine, outputs: list[StepOutput],
               refused: list[RankOutput]) -> RankStepDone:
    return RankStepDone(outputs=refused + [_rank_output(s) for s in outputs],
                        moe=engine.ep_timer.take(), pause_s=engine.last_pause_s)


class DEPEngine:
    """Rank 0 of N lockstep DEP ranks: the add / abort / step / has_unfinished surface of an
    Engine, over the whole group."""

    def __init__(self, config: EngineConfig) -> None:
        world = config.expert_parallel_size
        self.model_dir = model_directory(config.model)
        cfg = load_model_config(self.model_dir)
        if not cfg.is_moe:
            raise ModelLoadError("expert_parallel_size needs a MoE model")
        config = dataclasses.replace(config, num_ep_ranks=world)
        slots = cfg.num_experts + config.num_redundant_experts
        if slots % world:
            raise ValueError(f"{slots} expert slots (experts + num_redundant_experts) do not "
                             f"split over expert_parallel_size {world}")
        name = f"ep-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        ctx = torch.multiprocessing.get_context("spawn")
        self.procs = [ctx.Process(target=follower_main, name=f"evenflow-ep-rank{r}",
                                  args=(dataclasses.replace(config, show_progress=False), name,
                                        r), daemon=True)
                      for r in range(1, world)]
        for proc in self.procs:
            proc.start()
        try:
            self.rank0 = LockstepEngine(config, None, False, 0, name, peers_alive=lambda: all(
                p.exitcode is None for p in self.procs))
        except BaseException as exc:
            stop_ranks(self.procs, None)
            if isinstance(exc, ModelLoadError):
                raise ModelLoadError(f"{exc} (a script that starts ranks needs an "
                                     f"`if __name__ == \"__main__\":` guard)") from exc
            raise
        self._finalizer = weakref.finalize(
            self, stop_ranks, self.procs, self.rank0.group,
            functools.partial(self.rank0.decide_step, Meeting(stop=True)))
        self.model_config = self.rank0.model_config
        self.world_size = world
        self._owner: dict[str, int] = {}  # live request -> its rank
        # rank 0's mail for the next meeting (sent only when there is some)
        self._adds: list[RankAdd] = []
        self._aborts: list[str] = []
        self._placement: Placement | None = None
        self._take_load = False
        self._held: list[StepOutput] = []  # outputs of a meeting that step() has not returned
        self._rank0_step: RankStepDone | None = None  # waiting for the others' same step
        # per step (the latest MOE_TIMES_KEPT), per rank: [MoE compute s, collective s (incl.
        # waiting), rows computed]
        self.moe_times: deque[list[list[float]]] = deque(maxlen=MOE_TIMES_KEPT)
        # the longest time any rank spent switching a placement's layer before a step
        self.max_placement_pause_s = 0.0

    @property
    def engine(self) -> LockstepEngine:
        """Rank 0's own engine (its placement, counters, model)."""
        return self.rank0

    def take_slot_counts(self) -> torch.Tensor:
        """Tokens per (MoE layer, physical slot) since the last call, over every rank."""
        self._take_load = True
        counts = self._meet()
        assert counts is not None
        return counts

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        load = [0] * self.world_size
        for r in self._owner.values():
            load[r] += 1
        rank = load.index(min(load))
        self._owner[request_id] = rank
        self._adds.append(RankAdd(rank=rank, request_id=request_id,
                                  prompt_token_ids=list(prompt_token_ids),
                                  sampling=params))

    def abort(self, request_id: str) -> bool:
        if self._owner.pop(request_id, None) is None:
            return False
        self._aborts.append(request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._owner or self._aborts or self._held)

    def apply_placement(self, phy2log: torch.Tensor, share: torch.Tensor | None,
                        version: int) -> None:
        """A new expert placement on every rank: handed out at the next meeting, agreed at the
        one after, then taken one MoE layer per step (each rank reading the experts its slots
        newly hold: engine/weights/expert_store.py)."""
        self._placement = Placement.of(phy2log, share, version=version)

    def step(self) -> list[StepOutput]:
        self._meet()
        held, self._held = self._held, []
        for out in held:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return held

    def _meet(self) -> torch.Tensor | None:
        """One meeting (and the step it decides): rank 0's mail out, the others' last steps
        in; their outputs and rank 0's own are held for step()."""
        mail = None
        if self._adds or self._aborts or self._placement is not None or self._take_load:
            mail = Meeting(adds=self._adds, aborts=self._aborts, placement=self._placement,
                           take_load=self._take_load)
            self._adds, self._aborts, self._placement, self._take_load = [], [], None, False
        busy = self.rank0.decide_step(mail)
        if self.rank0.fatal_error is not None:
            raise RuntimeError(self.rank0.fatal_error)
        taken = take_mail(self.rank0, 0)
        for done in taken.done:
            self._hold(done)
        if taken.done and self._rank0_step is not None:
            ranks = [self._rank0_step, *taken.done]
            self.moe_times.append([r.moe for r in ranks])
            self.max_placement_pause_s = max(self.max_placement_pause_s,
                                             max(r.pause_s for r in ranks))
            self._rank0_step = None
        if busy:
            mine = _step_done(self.rank0, self.rank0.step(), taken.refused)
            self._hold(mine)
            self._rank0_step = mine
        return taken.slot_counts

    def _hold(self, done: RankStepDone) -> None:
        for out in done.outputs:
            if out.refused:
                self._owner.pop(out.request_id, None)
                raise ValueError(out.refused)
            self._held.append(_step_output(out))

    def close(self) -> None:
        self._finalizer()


def follower_main(config: EngineConfig, group_name: str, rank: int) -> None:
    """A rank other than 0: load, then meet and step until told to stop or until rank 0 is
    gone."""
    engine = LockstepEngine(config, None, False, rank, group_name)
    done: RankStepDone | None = None
    try:
        while True:
            busy = engine.decide_step(Meeting(done=done) if done is not None else None,
                                      patient=True)
            if engine.fatal_error is not None:
                return  # rank 0 is gone or stopped answering
            taken = take_mail(engine, rank)
            if taken.stop:
                return
            done = _step_done(engine, engine.step(), taken.refused) if busy else None
    finally:
        engine.close()
