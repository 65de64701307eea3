"""MLA's native decode (engine/kernels/mla_decode.cpp) gives what the absorbed form in torch
gives: queries through W_uk, attention over each sequence's latents where they lie in the paged
cache (ragged contexts, slots in any order), values up through W_uv; over a bf16, float32 and
an int8 cache, at batch sizes that split the heads into groups and at ones that do not."""

from __future__ import annotations

import pytest
import torch

from evenflow.engine.kernels import native
from evenflow.engine.model.kv_quant import gather_dequantized, write_quantized_torch


def absorbed_reference(q_nope, q_pe, w_uk, w_uv, latents, slots, lens, scale):
    """The absorbed form in float64, one sequence at a time: latents (slots, 1, rank + rope)
    already dequantized."""
    rank = w_uk.shape[-1]
    out = []
    for b in range(q_nope.shape[0]):
        ctx = latents[slots[b, : lens[b]], 0].double()  # (L, rank + rope)
        q_lat = torch.einsum("hd,hdr->hr", q_nope[b].double(), w_uk.double())
        q = torch.cat([q_lat, q_pe[b].double()], dim=-1)  # (heads, rank + rope)
        p = torch.softmax(q @ ctx.T * scale, dim=-1)  # (heads, L)
        o = p @ ctx[:, :rank]  # (heads, rank)
        out.append(torch.einsum("hvr,hr->hv", w_uv.double(), o))
    return torch.stack(out)


def mla_inputs(dtype, batch, heads, seed=0, nope=32, rope=16, rank=64, v_dim=48):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, nope + rope, generator=g).to(dtype)
    w = (torch.randn(heads * (nope + v_dim), rank, generator=g) * 0.2).to(dtype)
    w_uk = w[: heads * nope].view(heads, nope, rank)
    w_uv = w[heads * nope :].view(heads, v_dim, rank)
    latents = torch.randn(400, 1, rank + rope, generator=g).to(dtype)
    width = 90
    slots = torch.stack([torch.randperm(399, generator=g)[:width] for _ in range(batch)])
    lens = torch.randint(1, width + 1, (batch,), generator=g)
    lens[0] = 1
    slots[0, 1:] = -1  # (a slot past lens is never read: out of range would crash)
    # q_nope and q_pe as the model passes them: views of one projection's output
    return q[..., :nope], q[..., nope:].contiguous(), w_uk, w_uv, latents, slots, lens


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
# (1 or 2 sequences stream the weights; more go in register blocks, with partial blocks of
# sequences and of W_uv's rows at 5 sequences and v_dim 50)
@pytest.mark.parametrize("batch, heads, v_dim", [(1, 16, 48), (3, 5, 48), (8, 16, 48),
                                                 (2, 70, 48), (5, 3, 50)])
def test_matches_the_absorbed_form(dtype, tolerance, batch, heads, v_dim):
    kernels = native.mla_decode()
    if kernels is None:
        pytest.skip("native kernels unavailable")
    q_nope, q_pe, w_uk, w_uv, latents, slots, lens = mla_inputs(dtype, batch, heads,
                                                                 v_dim=v_dim)
    scale = 0.11
    got = kernels.mla_decode(q_nope, q_pe, w_uk, w_uv, latents, slots, lens, scale)
    assert got.dtype == dtype and got.shape == (batch, heads, w_uv.shape[1])
    want = absorbed_reference(q_nope, q_pe, w_uk, w_uv, latents, slots, lens, scale)
    torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance)


def test_int8_cache_matches_its_dequantized_values():
    kernels = native.mla_decode()
    if kernels is None:
        pytest.skip("native kernels unavailable")
    q_nope, q_pe, w_uk, w_uv, latents, slots, lens = mla_inputs(torch.bfloat16, 4, 16, seed=1)
    block_size = 16
    blocks = latents.shape[0] // block_size  # (the engine's layout: blocks, one null slot)
    cache = torch.zeros(blocks * block_size + 1, 1, latents.shape[2], dtype=torch.int8)
    scales = torch.zeros(blocks + 1, 1)
    written = torch.arange(latents.shape[0])
    write_quantized_torch(latents, cache, scales, written, block_size)
    scales[3] = 0.0  # a block of zeros (scale 0) is still attended to: its scores are 0
    cache[3 * block_size : 4 * block_size] = 0
    got = kernels.mla_decode_int8(q_nope, q_pe, w_uk, w_uv, cache, scales, slots, lens, 0.1,
                                  block_size)
    dequantized = gather_dequantized(cache, scales, written, torch.float32)
    want = absorbed_reference(q_nope, q_pe, w_uk, w_uv, dequantized, slots, lens, 0.1)
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)


def test_bad_shapes_are_refused_not_read():
    kernels = native.mla_decode()
    if kernels is None:
        pytest.skip("native kernels unavailable")
    q_nope, q_pe, w_uk, w_uv, latents, slots, lens = mla_inputs(torch.float32, 2, 4)
    with pytest.raises(RuntimeError, match="lens must lie"):
        kernels.mla_decode(q_nope, q_pe, w_uk, w_uv, latents, slots, lens + 100, 0.1)
    bad = slots.clone()
    bad[1, 0] = 10_000
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.mla_decode(q_nope, q_pe, w_uk, w_uv, latents, bad, lens, 0.1)
    with pytest.raises(RuntimeError, match="rank"):
        kernels.mla_decode(q_nope, q_pe, w_uk, w_uv, latents[..., :-3].contiguous(), slots,
                           lens, 0.1)
