"""Tensor parallelism: TP=2 gives TP=1's output on every supported architecture (fp32 logits
within 1e-4, greedy tokens identical, prefix-cache hits and K/V hand-off included), a dead rank
is an error within a bounded time, and no rank process or /dev/shm entry outlives the engine."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import torch
from checkpoints import VOCAB, make_checkpoint

from evenflow import LLM, SamplingParams
from evenflow.engine.runners.tp import TensorParallelLost
from evenflow.engine.serving.engine import Engine, EngineConfig
from evenflow.parallel.launch import run_ranks
from evenflow.parallel.shm import SHM_DIR

pytestmark = pytest.mark.slow  # rank processes loading models: ~110 s

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


# One per way a layer splits (dense, q/k norm per head or over the whole projection, biases,
# experts, shared expert, MLA heads over a whole latent, sinks and expert biases); the other
# families differ in rope or config only, which the split does not touch.
TP_ARCHS = ["llama", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3",
            "gpt_oss"]


@pytest.fixture(scope="module", params=TP_ARCHS)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, path)
    return path


def prompts(lengths, seed=1, prefix=()):
    g = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def rank_logits(rank: int, world: int, path: str, name: str, prompt: list[int]) -> list:
    """One prefill of `prompt` on this rank's shard: the last position's logits, every rank."""
    from evenflow.engine.runners.model_runner import ChunkInput, ModelRunner
    from evenflow.engine.weights.loader import load_model
    from evenflow.engine.weights.tp_shard import TPShard
    from evenflow.parallel.shm import ShmGroup

    torch.set_num_threads(1)
    group = ShmGroup(name, rank, world)
    model = load_model(path, torch.float32, None, TPShard(rank, world) if world > 1 else None)
    if world > 1:
        model.set_tensor_parallel(group)
    runner = ModelRunner(model, num_blocks=16, block_size=8, max_model_len=128,
                         dtype=torch.float32)
    blocks = list(range(-(-len(prompt) // 8)))
    logits = runner.forward([ChunkInput(prompt, 0, blocks, True)])
    # then one decode step over the cached prompt
    logits2 = runner.forward([ChunkInput([5], len(prompt), blocks + [len(blocks)], True)])
    group.close()
    return [logits[0].tolist(), logits2[0].tolist()]


def test_tp2_logits_match_tp1(checkpoint):
    prompt = prompts([21])[0]
    name = f"tptest-{uuid.uuid4().hex[:8]}"
    (one,) = run_ranks(rank_logits, 1, str(checkpoint), name + "a", prompt)
    two = run_ranks(rank_logits, 2, str(checkpoint), name + "b", prompt)
    for step in range(2):
        reference = torch.tensor(one[step])
        for rank in range(2):
            diff = (torch.tensor(two[rank][step]) - reference).abs().max().item()
            assert diff < 1e-4, f"step {step} rank {rank}: max abs diff {diff}"
    assert not [p for p in SHM_DIR.iterdir() if name in p.name]


def test_tp2_greedy_tokens_match_tp1(checkpoint):
    batch = prompts([1, 5, 17, 40])
    shared = prompts([3, 9], seed=2, prefix=prompts([24], seed=7)[0])
    single = LLM(str(checkpoint), dtype="float32", block_size=8)
    expected = [o.token_ids for o in single.generate(batch + shared, GREEDY)]
    llm = LLM(str(checkpoint), dtype="float32", block_size=8, tensor_parallel_size=2)
    try:
        got = llm.generate(batch, GREEDY) + llm.generate(shared, GREEDY)
        assert [o.token_ids for o in got] == expected
        assert got[-1].num_cached_tokens == 24  # the shared prefix came from the cache
    finally:
        llm.engine.close()


def test_kv_handoff_between_tp_sizes(tmp_path):
    """A TP=2 prefill hands its K/V to a TP=1 decode engine and back: same tokens as TP=1."""
    path = tmp_path / "ckpt"
    make_checkpoint("qwen3_moe", path)
    prompt = prompts([30])[0]
    config = dict(model=str(path), dtype="float32", block_size=8)
    expected = LLM(**config).generate([prompt], GREEDY)[0].token_ids
    tp2 = Engine(EngineConfig(**config, tensor_parallel_size=2))
    tp1 = Engine(EngineConfig(**config))
    try:
        for prefill, decode in ((tp2, tp1), (tp1, tp2)):
            prefill.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1),
                                export_kv=True)
            first = prefill.step()[0].new_token_ids[0]
            kv = prefill.step()[0].kv
            decode.add_prefilled_request("r", prompt, first, GREEDY, kv)
            tokens = [first]
            while decode.has_unfinished():
                tokens += [t for out in decode.step() for t in out.new_token_ids]
            assert tokens == expected
    finally:
        tp2.close()


def test_a_dead_rank_fails_the_engine_within_seconds(tmp_path):
    path = tmp_path / "ckpt"
    make_checkpoint("llama", path)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=2))
    follower = engine._tp.procs[0]
    try:
        engine.add_request("a", prompts([10])[0], GREEDY)
        engine.step()
        os.kill(follower.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(TensorParallelLost):
            while True:
                engine.step()
                assert time.monotonic() - started < 10
        assert time.monotonic() - started < 10
        assert engine.fatal_error is not None
    finally:
        engine.close()
    assert not follower.is_alive()


def test_followers_stop_with_the_engine(tmp_path):
    path = tmp_path / "ckpt"
    make_checkpoint("llama", path)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=2))
    procs = list(engine._tp.procs)
    engine.close()
    assert all(not p.is_alive() and p.exitcode == 0 for p in procs)


def test_a_k_norm_over_replicated_kv_heads_is_refused_with_a_clear_error(tmp_path):
    path = tmp_path / "ckpt"
    make_checkpoint("olmoe", path, overrides=dict(num_key_value_heads=1))
    with pytest.raises(Exception, match="must divide OlmoeForCausalLM's 1 KV heads"):
        Engine(EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=2))


def test_uneven_split_is_refused_with_a_clear_error(tmp_path):
    path = tmp_path / "ckpt"
    make_checkpoint("llama", path)  # 4 heads
    with pytest.raises(Exception, match="tensor_parallel_size 3 must divide"):
        Engine(EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=3))
