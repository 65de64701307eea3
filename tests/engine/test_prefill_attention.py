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


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("q_len, ctx", [(150, 150), (90, 260), (1, 200)])
@pytest.mark.parametrize("window", [0, 48, 128])
def test_sliding_windows_and_sinks_match_torch(dtype, tolerance, q_len, ctx, window):
    """GPT-OSS's attention in the kernel: each query sees its last `window` keys (0: all), and
    each head's sink logit joins the softmax (model/attention.py windowed_attention is the
    reference)."""
    from evenflow.engine.model.attention import windowed_attention

    heads, kv_heads, hd = 8, 2, 64
    kernel = kernel_or_skip(dtype, hd, heads // kv_heads)
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(300, kv_heads, hd, generator=g).to(dtype) for _ in range(2))
    slots = torch.randperm(300, generator=g)[:ctx]
    q = (torch.randn(q_len, heads, hd, generator=g) * 2).to(dtype)
    sinks = torch.randn(heads, generator=g) * 3
    got = kernel(q, k_cache, v_cache, slots, hd**-0.5, window, sinks)
    k, v = (c[slots].float().transpose(0, 1).unsqueeze(0) for c in (k_cache, v_cache))
    want = windowed_attention(q.float().transpose(0, 1).unsqueeze(0), k, v,
                              torch.arange(ctx - q_len, ctx).unsqueeze(0),
                              torch.arange(ctx).unsqueeze(0), None, window, sinks, hd**-0.5)
    torch.testing.assert_close(got.float(), want[0].transpose(0, 1), atol=tolerance,
                               rtol=tolerance)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hd, heads, kv_heads", [(64, 8, 2), (64, 6, 2), (48, 4, 2)])
def test_paged_decode_takes_sinks(dtype, tolerance, hd, heads, kv_heads):
    """The paged decode kernel with sinks (both of its paths: register-resident for head dims 64
    and 128 with even groups, the general loop otherwise) against windowed_attention."""
    from evenflow.engine.model.attention import windowed_attention

    paged = native.decode_attention()
    if paged is None:
        pytest.skip("no native kernels")
    g = torch.Generator().manual_seed(4)
    k_cache, v_cache = (torch.randn(200, kv_heads, hd, generator=g).to(dtype) for _ in range(2))
    lens = torch.tensor([1, 37, 120])
    slots = torch.stack([torch.randperm(200, generator=g)[:120] for _ in range(3)])
    q = torch.randn(3, heads, hd, generator=g).to(dtype)
    sinks = torch.randn(heads, generator=g) * 3
    got = paged(q, k_cache, v_cache, slots, lens, hd**-0.5, sinks)
    for b in range(3):
        n = int(lens[b])
        k, v = (c[slots[b, :n]].float().transpose(0, 1).unsqueeze(0) for c in (k_cache, v_cache))
        want = windowed_attention(q[b].float().unsqueeze(0).unsqueeze(2), k, v,
                                  torch.tensor([[n - 1]]), torch.arange(n).unsqueeze(0), None, 0,
                                  sinks, hd**-0.5)
        torch.testing.assert_close(got[b].float(), want[0, :, 0], atol=tolerance,
                                   rtol=tolerance)


def test_gpt_oss_with_head_dim_64_takes_the_kernels_and_matches_transformers(tmp_path,
                                                                             monkeypatch):
    """GPT-OSS (a sliding window of 24, sinks) where both native attention kernels serve it:
    chunked prompts longer than the window, prompts arriving while others decode."""
    kernel = kernel_or_skip(torch.float32, 64, 2)
    calls = []

    def counted(*args):
        calls.append(args[5] if len(args) > 5 else 0)  # the window each call asked for
        return kernel(*args)

    monkeypatch.setattr(native, "prefill_attention", lambda: counted)
    hf = make_checkpoint("gpt_oss", tmp_path, overrides=dict(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        sliding_window=24, intermediate_size=64))
    hf.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (100, 9, 60)]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(tmp_path), dtype="float32", block_size=16,
                                 max_num_batched_tokens=40))
    produced = run_with_arrivals(engine, prompts, greedy, arrivals=[0, 3, 4])
    assert 24 in calls and 0 in calls  # sliding and full layers both took the kernel
    for prompt, tokens in zip(prompts, produced, strict=True):
        assert tokens == hf_greedy(hf, prompt, 30)
