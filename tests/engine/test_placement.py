"""The engine under an expert placement: replicas serve tokens, counts are per physical slot,
and a new placement moves weights without changing greedy output."""

from __future__ import annotations

import torch

from evenflow import LLM, SamplingParams
from evenflow.engine.model.placement import rank_balancedness

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["count from 17 :", "reverse : a b c d =", "count down from 90 :"]


def test_greedy_output_is_unchanged_across_placements():
    plain = [o.token_ids for o in LLM("tiny-moe").generate(PROMPTS, GREEDY)]
    llm = LLM("tiny-moe", num_ep_ranks=4, num_redundant_experts=4)  # 12 slots, 3 per rank
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain
    counts = llm.engine.placement.take_slot_counts()
    assert counts.shape == (4, 12) and int(counts.sum()) > 0
    before = rank_balancedness(counts, 4)
    # Replicate each layer's hottest experts and spread them: a real placement change.
    from evenflow.balancer.eplb import rebalance_experts  # the pure algorithm, for the test

    logical = torch.zeros(4, 8).scatter_add_(
        1, llm.engine.model.moe_layers()[0].placement.phy2log.repeat(4, 1), counts.float())
    placement = rebalance_experts(logical, 12, 1, 1, 4)
    llm.engine.placement.apply_placement(placement.phy2log, None, version=1)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain
    after = rank_balancedness(llm.engine.placement.take_slot_counts(), 4)
    assert after > before
