"""Expert parallelism with data-parallel attention (offline): EP=2 gives EP=1's output on every
MoE architecture (fp32 logits within 1e-4, greedy tokens identical), with replicated experts
and across a placement change mid-generation; the ranks and their shm segment go away with the
engine."""

from __future__ import annotations

import uuid

import pytest
import torch
from checkpoints import VOCAB, make_checkpoint

from evenflow import LLM, SamplingParams
from evenflow.parallel.launch import run_ranks
from evenflow.parallel.shm import SHM_DIR

pytestmark = pytest.mark.slow  # rank processes loading models: ~60 s

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
MOE_ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"]


@pytest.fixture(scope="module", params=MOE_ARCHS)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, path)
    return path


def prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def rank_logits(rank: int, world: int, path: str, name: str, batch: list) -> list:
    """Rank r prefills batch[r] (its own sequence: attention is data-parallel) and decodes one
    token; returns both steps' last-position logits."""
    from evenflow.engine.runners.model_runner import ChunkInput
    from evenflow.engine.serving.engine import Engine, EngineConfig
    from evenflow.parallel.shm import ShmGroup

    torch.set_num_threads(1)
    group = ShmGroup(name, rank, world)
    engine = Engine(EngineConfig(model=path, dtype="float32", block_size=8, num_ep_ranks=2,
                                 num_redundant_experts=2, expert_parallel_size=world),
                    ep_group=group if world > 1 else None)
    mine = batch[rank] if world > 1 else batch
    logits = []
    for prompt in mine:
        blocks = list(range(-(-len(prompt) // 8) + 1))
        first = engine.runner.forward([ChunkInput(prompt, 0, blocks, True)])
        second = engine.runner.forward([ChunkInput([5], len(prompt), blocks, True)])
        logits.append([first[0].tolist(), second[0].tolist()])
    group.close()
    return logits


def test_ep2_logits_match_ep1(checkpoint):
    batch = prompts([21, 9])
    name = f"eptest-{uuid.uuid4().hex[:8]}"
    (single,) = run_ranks(rank_logits, 1, str(checkpoint), name + "a", batch)
    split = run_ranks(rank_logits, 2, str(checkpoint), name + "b", [[batch[0]], [batch[1]]])
    for rank in range(2):
        for step in range(2):
            diff = (torch.tensor(split[rank][0][step]) - torch.tensor(single[rank][step])).abs()
            assert diff.max().item() < 1e-4, f"rank {rank} step {step}: {diff.max().item()}"
    assert not [p for p in SHM_DIR.iterdir() if name in p.name]


def test_ep2_greedy_tokens_match_ep1_with_replicas(checkpoint):
    batch = prompts([1, 5, 17, 40, 12])
    config = dict(dtype="float32", block_size=8, num_redundant_experts=2)
    expected = [o.token_ids for o in LLM(str(checkpoint), **config).generate(batch, GREEDY)]
    llm = LLM(str(checkpoint), expert_parallel_size=2, **config)
    try:
        assert [o.token_ids for o in llm.generate(batch, GREEDY)] == expected
    finally:
        llm.engine.close()


@pytest.mark.parametrize("form", [dict(), dict(quantization="int8"),
                                  dict(prepack_weights=False)], ids=["packed", "int8", "plain"])
def test_a_placement_change_mid_generation_keeps_the_tokens(tmp_path, form):
    path = tmp_path / "ckpt"
    make_checkpoint("qwen3_moe", path)  # 8 experts + 2 replicas = 10 slots, 5 per rank
    batch = prompts([7, 30, 3])
    config = dict(dtype="float32", block_size=8, num_redundant_experts=2, **form)
    expected = [o.token_ids for o in LLM(str(path), **config).generate(batch, GREEDY)]
    llm = LLM(str(path), expert_parallel_size=2, **config)
    engine = llm.engine
    first_moe = engine.engine.model.moe_layers()[0]
    assert set(first_moe.resident) == {0, 1, 2, 3, 4}  # rank 0's slots: experts 0-4 only
    row = [7, 6, 5, 4, 3, 2, 1, 0, 3, 5]
    try:
        for i, p in enumerate(batch):
            engine.add_request(str(i), p, GREEDY)
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(batch))}
        steps = 0
        while engine.has_unfinished():
            if steps == 6:  # hot experts 3 and 5 get the replicas, all moved across ranks
                layers = engine.model_config.num_moe_layers
                engine.apply_placement(torch.tensor([row] * layers), None, version=1)
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
            steps += 1
        assert [tokens[str(i)] for i in range(len(batch))] == expected
        assert engine.engine.placement.version == 1
        # rank 0 now holds its new slots' experts and nothing else; the ones it lacked were
        # read from the checkpoint, one layer per step
        assert set(first_moe.resident) == set(row[:5])
        moves = engine.engine.placement.moves
        assert moves.layers == layers and moves.experts_read == 3 * layers  # 5, 6, 7 are new
    finally:
        engine.close()
    assert all(not p.is_alive() for p in engine.procs)
