"""The engine's fused kernels give what the torch ops they replace give: the paged decode
attention (engine/kernels/paged_attention.cpp, K and V read where they lie in the cache), the
RMSNorm / residual-add + RMSNorm (engine/kernels/norm.cpp, bit-identical in bf16) and the rotary
+ KV write (engine/kernels/rotary.cpp, bit-identical); the engine's greedy output is the same
with them and without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from evenflow.engine.kernels import native


def reference(q, k_cache, v_cache, slots, lens):
    heads, kv_heads, hd = q.shape[1], k_cache.shape[1], q.shape[2]
    out = []
    for b in range(q.shape[0]):
        ctx = slots[b, : lens[b]]
        k, v = (c[ctx].float().transpose(0, 1) for c in (k_cache, v_cache))
        qb = q[b].float().view(kv_heads, heads // kv_heads, hd)
        out.append(F.scaled_dot_product_attention(qb, k, v).reshape(heads, hd))
    return torch.stack(out)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
# head dim 64 and 128 take the register-resident path on AVX-512 builds (8 or 3 queries per KV
# head: in sub-groups of 4, 2 or 1), head dim 32 the general loop
@pytest.mark.parametrize("heads, kv_heads, hd", [(8, 2, 64), (8, 8, 64), (12, 4, 64), (4, 2, 128),
                                                 (32, 8, 128), (16, 2, 128), (4, 4, 32)])
def test_matches_torch_attention(dtype, tolerance, heads, kv_heads, hd):
    kernel = native.decode_attention()
    if kernel is None:
        pytest.skip("native kernels unavailable")
    g = torch.Generator().manual_seed(0)
    batch, width, slots_total = 4, 70, 300
    q = (torch.randn(batch, heads, hd, generator=g) * 2).to(dtype)
    k_cache, v_cache = (torch.randn(slots_total, kv_heads, hd, generator=g).to(dtype)
                        for _ in range(2))
    slots = torch.stack([torch.randperm(slots_total, generator=g)[:width] for _ in range(batch)])
    lens = torch.tensor([1, 70, 33, 17])  # the rest of each row is padding, never read
    slots[0, 1:] = -1  # (an out-of-range slot past lens would crash if it were read)
    got = kernel(q, k_cache, v_cache, slots, lens, hd**-0.5)
    torch.testing.assert_close(got.float(), reference(q, k_cache, v_cache, slots, lens),
                               atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_torch(dtype):
    kernels = native.norms()
    if kernels is None:
        pytest.skip("native kernels unavailable")
    g = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(7, 520, generator=g).to(dtype) for _ in range(2))
    weight = (torch.rand(520, generator=g) + 0.5).to(dtype)  # (520: whole vectors and a tail)
    exact = dtype == torch.bfloat16  # (float32 sums in another order: within an ulp or two)
    check = torch.testing.assert_close if not exact else (
        lambda a, b: torch.testing.assert_close(a, b, atol=0, rtol=0))
    check(kernels.rms_norm(x, weight, 1e-5), F.rms_norm(x, (520,), weight, 1e-5))
    total, normed = kernels.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, x + residual)
    check(normed, F.rms_norm(x + residual, (520,), weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hd", [64, 128, 48])  # (48: half a head is not whole vectors)
def test_rotary_and_kv_write_are_bit_identical_to_torch(dtype, hd):
    fused = native.rotary_kv_write()
    if fused is None:
        pytest.skip("native kernels unavailable")
    g = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads = 5, 8, 2
    qkv = (torch.randn(tokens, heads + 2 * kv_heads, hd, generator=g) * 3).to(dtype)
    cos, sin = (torch.randn(tokens, 1, hd, generator=g).to(dtype) for _ in range(2))
    k_cache, v_cache = (torch.zeros(40, kv_heads, hd, dtype=dtype) for _ in range(2))
    slots = torch.tensor([3, 9, 10, 31, 0])
    q = fused(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads)
    qk = qkv[:, : heads + kv_heads]
    # engine/model/attention.py's torch path
    rotated = qk * cos + torch.roll(qk, hd // 2, -1) * sin
    assert torch.equal(q, rotated[:, :heads]) and torch.equal(k_cache[slots], rotated[:, heads:])
    assert torch.equal(v_cache[slots], qkv[:, heads + kv_heads :])
    with pytest.raises(RuntimeError, match="outside the cache"):
        fused(qkv, cos, sin, k_cache, v_cache, torch.tensor([0, 1, 2, 3, 40]), heads, kv_heads)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_output_is_the_same_with_and_without_them(monkeypatch, dtype):
    from evenflow import LLM, SamplingParams

    if native.decode_attention() is None or native.norms() is None:
        pytest.skip("native kernels unavailable")
    llm = LLM("tiny-moe", dtype=dtype)
    prompts = ["count from 17 :", "count down from 90 :", "reverse : q w e r ="]
    if dtype == "float32":  # free-form output has near ties that bf16 rounding may flip
        prompts.append("json =")
    params = SamplingParams(temperature=0, max_tokens=12)
    with_kernels = [o.token_ids for o in llm.generate(prompts, params)]
    monkeypatch.setattr(native, "decode_attention", lambda: None)
    monkeypatch.setattr(native, "norms", lambda: None)
    monkeypatch.setattr(native, "rotary_kv_write", lambda: None)
    assert [o.token_ids for o in llm.generate(prompts, params)] == with_kernels
