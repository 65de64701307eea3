"""The causal prefill attention kernel (engine/kernels/prefill_attention.cpp) gives torch's
attention over the context's cache slots, with and without a cached prefix; served prompts that
take it — long, chunked, hitting the prefix cache — stay token-identical to transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from checkpoints import VOCAB, hf_greedy, make_checkpoint, run_with_arrivals

from evenflow import SamplingParams
from evenflow.engine.kernels import native
from evenflow.engine.serving.engine import Engine, EngineConfig


def reference(q, k_cache, v_cache, slots):
    """torch's attention in float32: each query sees the context up to its own position."""
    q_len, ctx, kv_heads = q.shape[0], slots.shape[0], k_cache.shape[1]
    k, v = (c[slots].float().transpose(0, 1) for c in (k_cache, v_cache))  # (kv, ctx, hd)
    qh = q.float().transpose(0, 1)  # (heads, q_len, hd)
    visible = torch.arange(ctx).unsqueeze(0) <= torch.arange(q_len).unsqueeze(1) + ctx - q_len
    out = F.scaled_dot_product_attention(qh, k, v, attn_mask=visible,
                                         enable_gqa=kv_heads != q.shape[1])
    return out.transpose(0, 1)


def kernel_or_skip(dtype: torch.dtype, hd: int, group: int):
    if not native.prefill_attention_serves(dtype, hd, group):
        pytest.skip("the prefill attention kernel does not serve this dtype / shape here")
    kernel = native.prefill_attention()
    assert kernel is not None
    return kernel


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads, hd", [(8, 2, 64), (8, 8, 64), (12, 4, 64), (4, 2, 128),
                                                 (16, 1, 64), (2, 1, 192)])
# (queries, context): the whole context new; a cached prefix; one query over 129 keys
@pytest.mark.parametrize("q_len, ctx", [(70, 70), (100, 300), (1, 129)])
def test_matches_torch_attention(dtype, tolerance, heads, kv_heads, hd, q_len, ctx):
    kernel = kernel_or_skip(dtype, hd, heads // kv_heads)
    g = torch.Generator().manual_seed(0)
    slots_total = 400
    k_cache, v_cache = (torch.randn(slots_total, kv_heads, hd, generator=g).to(dtype)
                        for _ in range(2))
    slots = torch.randperm(slots_total, generator=g)[:ctx]  # blocks scattered over the cache
    # q as the model hands it over: a view into the fused (q, k) projection
    qk = (torch.randn(q_len, heads + kv_heads, hd, generator=g) * 2).to(dtype)
    q = qk[:, :heads]
    got = kernel(q, k_cache, v_cache, slots, hd**-0.5)
    assert got.shape == (q_len, heads, hd) and got.dtype == dtype
    torch.testing.assert_close(got.float(), reference(q, k_cache, v_cache, slots),
                               atol=tolerance, rtol=tolerance)


@pytest.fixture(scope="module")
def llama_hd64(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_hd64")
    hf = make_checkpoint("llama", path, overrides=dict(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2))
    hf.generation_config.eos_token_id = None
    return path, hf


def test_long_chunked_prompts_sharing_a_prefix_match_transformers(llama_hd64, monkeypatch):
    path, hf = llama_hd64
    kernel = kernel_or_skip(torch.float32, 64, 2)
    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        return kernel(*args)

    monkeypatch.setattr(native, "prefill_attention", lambda: counted)
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, VOCAB, (160,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (90, 7)]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # chunks of 64 tokens: every chunk after the first attends to the cache
    engine = Engine(EngineConfig(model=str(path), dtype="float32", block_size=16,
                                 max_num_batched_tokens=64))
    produced: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for i, prompt in enumerate(prompts):  # one after the other: the second hits the prefix
        engine.add_request(str(i), prompt, greedy)
        while engine.has_unfinished():
            for out in engine.step():
                produced.setdefault(out.request_id, []).extend(out.new_token_ids)
                cached[out.request_id] = out.num_cached_tokens
    assert cached["1"] == 160
    assert len(calls) >= 2 * 4  # (2 layers) every prefill chunk went through the kernel
    for i, prompt in enumerate(prompts):
        assert produced[str(i)] == hf_greedy(hf, prompt, 16)


def test_prompts_arriving_while_others_decode_match_transformers(llama_hd64):
    """Steps that hold prefill chunks (the kernel) and decoding sequences at once."""
    path, hf = llama_hd64
    kernel_or_skip(torch.float32, 64, 2)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (150, 9, 120, 70)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(path), dtype="float32", block_size=16,
                                 max_num_batched_tokens=48))
    # prompt 0 is chunked (150 > 48) and then decodes while 1, 2 and then 3 arrive
    produced = run_with_arrivals(engine, prompts, greedy, arrivals=[0, 5, 5, 6])
    for prompt, tokens in zip(prompts, produced, strict=True):
        assert tokens == hf_greedy(hf, prompt, 12)
