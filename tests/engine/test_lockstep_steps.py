"""A mesh DEP rank under its engine thread: the group decides once per loop whether to step
(decide_step, a collective), has_unfinished() only reads, and a new expert placement switches
exactly one MoE layer before each step."""

from __future__ import annotations

import asyncio
import uuid

import torch

from evenflow.engine.config.settings import EngineConfig
from evenflow.engine.dep.lockstep import LockstepEngine
from evenflow.proto.sampling import SamplingParams
from evenflow.services.engine_thread import AddRequest, ApplyPlacement, EngineThread, StepDone


def test_a_placement_switches_one_moe_layer_per_step():
    config = EngineConfig(model="tiny-moe", dtype="float32", expert_parallel_size=1,
                          num_ep_ranks=1, num_redundant_experts=2, max_num_seqs=4,
                          prepack_weights=False)  # (a group of one: experts kept unfused)
    engine = LockstepEngine(config, None, False, ep_rank=0, group_name=f"t-{uuid.uuid4().hex[:8]}")
    try:
        layers, slots = engine.placement.slot_counts.shape
        assert layers >= 2
        steps, switched_before_step, group_calls = [0], [], [0]
        step, apply_layer = engine.step, engine.runner.apply_layer_placement
        all_gather = engine.group.all_gather

        def counting_step():
            steps[0] += 1
            return step()

        def recording_layer(*args, **kwargs):
            switched_before_step.append(steps[0] + 1)  # the step this layer switches before
            return apply_layer(*args, **kwargs)

        def counting_all_gather(*args, **kwargs):
            group_calls[0] += 1
            return all_gather(*args, **kwargs)

        engine.step = counting_step  # type: ignore[method-assign]
        engine.runner.apply_layer_placement = recording_layer  # type: ignore[method-assign]
        engine.group.all_gather = counting_all_gather  # type: ignore[method-assign]
        # every layer: experts 0..E-1 on the first slots, replicas of experts 0 and 1 after them
        experts = slots - 2
        row = list(range(experts)) + [0, 1]
        placement = ApplyPlacement(1, row * layers, [1.0] * (layers * slots))
        assert engine.has_unfinished() is False and group_calls[0] == 0  # a read, no collective

        async def run() -> None:
            thread = EngineThread(engine, asyncio.get_running_loop())
            thread.start()
            thread.submit(placement)
            thread.submit(AddRequest("r1", [1, 2, 3, 4, 5], SamplingParams(
                temperature=0, max_tokens=layers + 4, ignore_eos=True)))
            try:
                while True:
                    event = await asyncio.wait_for(thread.events.get(), 60)
                    if isinstance(event, StepDone) and any(o.finished for o in event.outputs):
                        return
            finally:
                thread.stop()

        asyncio.run(run())
        # one layer before each step, on consecutive steps, every layer once
        assert len(switched_before_step) == layers
        assert switched_before_step == list(range(switched_before_step[0],
                                                  switched_before_step[0] + layers))
        assert engine.placement.version == 1
        assert torch.equal(engine.runner.model.moe_layers()[-1].placement.phy2log.cpu(),
                           torch.tensor(row))
    finally:
        engine.close()
