"""Expert-parallel ranks with data-parallel attention (DEP), offline: `LLM(model=...,
expert_parallel_size=N)`.

Each rank is a whole `Engine` of its own (scheduler, KV cache, sequences) in its own process,
except rank 0, which lives in the caller's process. Attention is data-parallel: a request
lives on one rank (the one with the fewest live requests when it arrives). MoE layers are
expert-parallel: under the expert placement (num_ep_ranks = N, slots rank-major) each rank
computes only its slots, and tokens travel to them and back by all-to-all (engine/model/ffn.py).

The ranks step in lockstep, as vLLM's and SGLang's DP attention do. Each step:
1. rank 0 broadcasts the step's command (runners/rank_wire.py: StepRanks with the new requests
   per rank and the aborts, or a Placement) as a header and the typed message; the others wait
   for it patiently (an idle group sleeps, no spin);
2. every rank steps its engine; a rank that ran no forward pass runs a dummy one (one token
   into the cache's spare slot), so every MoE layer's collectives meet;
3. the ranks' outputs (RankStepDone) are gathered to rank 0 (lengths, then encoded bytes).

Each rank also times its MoE layers per step (its experts' compute, and the dispatch/combine
collectives including the wait for the slowest rank): `DEPEngine.moe_times`.

Each rank keeps only the experts its slots hold; a placement change moves one MoE layer before
each of the next steps, every rank reading the experts it newly needs from the checkpoint
(engine/weights/expert_store.py). The mesh runs DEP ranks differently (engine/dep/lockstep.py: each
rank a worker of its own, no leader).
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
import weakref
from collections import deque
from typing import Any

import torch

from evenflow.engine.config import EngineConfig, ModelLoadError, load_config
from evenflow.engine.core.sampling_params import SamplingParams, spec_of
from evenflow.engine.core.sequence import FinishReason
from evenflow.engine.engine import Engine, StepOutput
from evenflow.engine.model.ffn import EPTimer
from evenflow.engine.runners.rank_wire import (
    LOAD_TIMEOUT_S,
    STEP_TIMEOUT_S,
    Placement,
    RankAdd,
    RankOutput,
    RankStepDone,
    StepRanks,
    Stop,
    TakeLoad,
    TokenLogprobs,
    gather,
    receive_command,
    send_command,
    stop_ranks,
)
from evenflow.engine.weights.loader import resolve_model
from evenflow.parallel.group import CollectiveError, ProcessGroup
from evenflow.parallel.shm import ShmGroup

MOE_TIMES_KEPT = 100_000


def slot_bytes_for(config: EngineConfig, hidden_size: int, top_k: int) -> int:
    """A shm slot that holds a full step's dispatch (every token to one rank) in float32."""
    rows = config.max_num_batched_tokens * max(1, top_k)
    return max(4 << 20, -(-(rows * hidden_size * 4 + 4096) // 64) * 64)


def _logprobs(entry: tuple[float, list[int], list[float]] | None) -> TokenLogprobs | None:
    return None if entry is None else TokenLogprobs(logprob=entry[0], top_ids=list(entry[1]),
                                                    top_logprobs=list(entry[2]))


def _rank_output(s: StepOutput) -> RankOutput:
    return RankOutput(
        request_id=s.request_id, new_token_ids=list(s.new_token_ids), finished=s.finished,
        finish_reason=s.finish_reason.value if s.finish_reason else "",
        num_prompt_tokens=s.num_prompt_tokens, num_cached_tokens=s.num_cached_tokens,
        logprobs=_logprobs(s.logprobs),
        prompt_logprobs=None if s.prompt_logprobs is None
        else [lp for lp in map(_logprobs, s.prompt_logprobs) if lp is not None])


def _step_output(o: RankOutput) -> StepOutput:
    def entry(lp: TokenLogprobs) -> tuple[float, list[int], list[float]]:
        return lp.logprob, lp.top_ids, lp.top_logprobs

    return StepOutput(o.request_id, o.new_token_ids, o.finished,
                      FinishReason(o.finish_reason) if o.finish_reason else None,
                      o.num_prompt_tokens, o.num_cached_tokens,
                      logprobs=entry(o.logprobs) if o.logprobs else None,
                      prompt_logprobs=None if o.prompt_logprobs is None
                      else [entry(lp) for lp in o.prompt_logprobs])


class LockstepRank:
    """One rank's engine and the per-step protocol every rank runs."""

    def __init__(self, config: EngineConfig, group: ProcessGroup) -> None:
        self.group = group
        self.engine = Engine(config, ep_group=group)
        self.timer = EPTimer()
        for layer in self.engine.model.moe_layers():
            layer.ep_timer = self.timer

    def run_step(self, rank: int, command: StepRanks) -> RankStepDone:
        """Apply this rank's share of the command and step."""
        engine, out = self.engine, []
        started = time.perf_counter()
        engine.advance_placement()  # one MoE layer of a new placement, on every rank alike
        pause = time.perf_counter() - started
        for request_id in command.aborts:
            engine.abort(request_id)
        for add in command.adds:
            if add.rank != rank:
                continue
            try:
                engine.add_request(add.request_id, add.prompt_token_ids, add.sampling)
            except ValueError as exc:
                out.append(RankOutput(request_id=add.request_id, refused=str(exc)))
        out.extend(_rank_output(s) for s in engine.step_in_lockstep())
        return RankStepDone(outputs=out, moe=self.timer.take(), pause_s=pause)

    def take_slot_counts(self) -> torch.Tensor:
        """Tokens per (MoE layer, slot) since the last call, summed over the ranks."""
        return self.group.all_reduce(self.engine.take_slot_counts())

    def apply_placement(self, placement: Placement) -> None:
        self.engine.begin_placement(*placement.tensors(), placement.version)


class DEPEngine:
    """Rank 0 of N lockstep DEP ranks: the add / abort / step / has_unfinished surface of an
    Engine, over the whole group."""

    def __init__(self, config: EngineConfig) -> None:
        world = config.expert_parallel_size
        self.model_dir = resolve_model(config.model)
        cfg = load_config(self.model_dir)
        if not cfg.is_moe:
            raise ModelLoadError("expert_parallel_size needs a MoE model")
        config = dataclasses.replace(config, num_ep_ranks=world)
        slots = cfg.num_experts + config.num_redundant_experts
        if slots % world:
            raise ValueError(f"{slots} expert slots (experts + num_redundant_experts) do not "
                             f"split over expert_parallel_size {world}")
        name = f"ep-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        slot_bytes = slot_bytes_for(config, cfg.hidden_size, cfg.num_experts_per_tok)
        ctx = torch.multiprocessing.get_context("spawn")
        self.procs = [ctx.Process(target=follower_main, name=f"evenflow-ep-rank{r}",
                                  args=(dataclasses.replace(config, show_progress=False), name,
                                        r, slot_bytes), daemon=True)
                      for r in range(1, world)]
        for proc in self.procs:
            proc.start()
        try:
            group = ShmGroup(name, 0, world, slot_bytes=slot_bytes, timeout_s=LOAD_TIMEOUT_S,
                             peers_alive=lambda: all(p.exitcode is None for p in self.procs))
        except CollectiveError as exc:
            for proc in self.procs:
                proc.kill()
            raise ModelLoadError(f"expert-parallel ranks did not start: {exc} (a script that "
                                 f"starts ranks needs an `if __name__ == \"__main__\":` "
                                 f"guard)") from exc
        self.group = group
        self._finalizer = weakref.finalize(self, stop_ranks, self.procs, group)
        try:
            self.rank = LockstepRank(config, group)
            group.barrier()  # every rank loaded
        except BaseException:
            self.close()
            raise
        group.timeout_s = STEP_TIMEOUT_S
        self.model_config = self.rank.engine.model_config
        self.world_size = world
        self._owner: dict[str, int] = {}  # live request -> its rank
        self._adds: list[RankAdd] = []
        self._aborts: list[str] = []
        # per step (the latest MOE_TIMES_KEPT), per rank: [MoE compute s, collective s (incl.
        # waiting), rows computed]
        self.moe_times: deque[list[list[float]]] = deque(maxlen=MOE_TIMES_KEPT)
        # the longest time any rank spent switching a placement's layer before a step
        self.max_placement_pause_s = 0.0

    def take_slot_counts(self) -> torch.Tensor:
        """Tokens per (MoE layer, physical slot) since the last call, over every rank."""
        send_command(self.group, TakeLoad())
        return self.rank.take_slot_counts()

    @property
    def engine(self) -> Any:
        """Rank 0's own engine (its placement, counters, model)."""
        return self.rank.engine

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
                                  sampling=spec_of(params)))

    def abort(self, request_id: str) -> bool:
        if self._owner.pop(request_id, None) is None:
            return False
        self._aborts.append(request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self._owner or self._aborts)

    def apply_placement(self, phy2log: torch.Tensor, share: torch.Tensor | None,
                        version: int) -> None:
        """A new expert placement on every rank, taken one MoE layer before each of the next
        steps (each rank reads the experts its slots newly hold: engine/weights/expert_store.py)."""
        placement = Placement.of(phy2log, share, version=version)
        send_command(self.group, placement)
        self.rank.apply_placement(placement)

    def step(self) -> list[StepOutput]:
        command = StepRanks(adds=self._adds, aborts=self._aborts)
        self._adds, self._aborts = [], []
        send_command(self.group, command)
        ranks = [done for done in gather(self.group, self.rank.run_step(0, command))
                 if isinstance(done, RankStepDone)]
        assert len(ranks) == self.world_size, "a rank answered a step with something else"
        self.moe_times.append([r.moe for r in ranks])
        self.max_placement_pause_s = max(self.max_placement_pause_s,
                                         max(r.pause_s for r in ranks))
        result = []
        for out in (out for r in ranks for out in r.outputs):
            if out.refused:
                self._owner.pop(out.request_id, None)
                raise ValueError(out.refused)
            if out.finished:
                self._owner.pop(out.request_id, None)
            result.append(_step_output(out))
        return result

    def close(self) -> None:
        self._finalizer()


def follower_main(config: EngineConfig, group_name: str, rank: int, slot_bytes: int) -> None:
    """A rank other than 0: load, then run rank 0's steps until STOP or until it is gone."""
    group = ShmGroup(group_name, rank, config.expert_parallel_size, slot_bytes=slot_bytes,
                     timeout_s=LOAD_TIMEOUT_S)
    try:
        me = LockstepRank(config, group)
        group.barrier()
        group.timeout_s = STEP_TIMEOUT_S
        while True:
            match receive_command(group):
                case Stop():
                    return
                case Placement() as placement:
                    me.apply_placement(placement)
                case TakeLoad():
                    me.take_slot_counts()
                case StepRanks() as command:
                    gather(group, me.run_step(rank, command))
                case other:
                    raise RuntimeError(f"an expert-parallel rank got {type(other).__name__}")
    except CollectiveError:
        pass  # rank 0 is gone or stopped answering
    finally:
        group.close()
