"""The int8 KV cache (kv_cache_dtype="int8"): the native write and attention equal the torch
rule they implement, the cache holds twice the blocks, the hand-off carries int8 blocks with
their scales (a disaggregated run equals a single engine's), and the torch fallback serves."""

from __future__ import annotations

import pytest
import torch
from checkpoints import make_checkpoint, prefill_then_decode

from evenflow import SamplingParams
from evenflow.engine.kernels import native
from evenflow.engine.model import kv_quant
from evenflow.engine.model.attention import gathered_decode_attention
from evenflow.engine.serving.engine import Engine, EngineConfig


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def ckpt(tmp_path_factory, request):
    """Grouped-query attention (K and V per KV head), and MLA (one latent of one head)."""
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, path)
    return path


def fill(write, block_size=16, kv_heads=4, head_dim=64, blocks=10):
    """A 21-token prefill then 19 decodes, growing in size (so scales grow and requantize),
    through `write`; -> (cache, scales, slots, the values written)."""
    torch.manual_seed(0)
    cache = torch.zeros(blocks * block_size + 1, kv_heads, head_dim, dtype=torch.int8)
    scales = torch.zeros(blocks + 1, kv_heads)
    table = [3, 7, 2]

    def slots(a, b):
        return torch.tensor([table[p // block_size] * block_size + p % block_size
                             for p in range(a, b)])

    x = torch.randn(21, kv_heads, head_dim).to(torch.bfloat16)
    write(x, cache, scales, slots(0, 21))
    for p in range(21, 40):
        y = (torch.randn(1, kv_heads, head_dim) * (1 + p / 10)).to(torch.bfloat16)
        write(y, cache, scales, slots(p, p + 1))
        x = torch.cat([x, y])
    return cache, scales, slots(0, 40), x


def test_native_int8_write_and_attention_equal_torch():
    if native.kv_int8() is None:
        pytest.skip("native kernels unavailable")
    kernels = native.kv_int8()
    c1, s1, slots, x = fill(lambda *a: kv_quant.write_quantized(*a, kernels))
    c2, s2, _, _ = fill(lambda *a: kv_quant.write_quantized_torch(*a, 16))
    assert torch.equal(s1, s2) and torch.equal(c1[slots], c2[slots])
    back = kv_quant.gather_dequantized(c1, s1, slots, torch.float32)
    # per-(block, head) scales: every value within a step of its block's largest
    assert (back - x.float()).abs().max() <= x.float().abs().max() / 127 * 1.5
    q = torch.randn(2, 8, 64).to(torch.bfloat16)
    both = torch.stack([slots, slots])
    out = kv_quant.paged_decode_attention_int8(kernels, q, c1, c1, s1, s1, both,
                                               torch.tensor([40, 33]), 0.125)
    mask = torch.zeros(2, 1, 1, 40, dtype=torch.bfloat16)
    mask[1, ..., 33:] = float("-inf")
    ref = gathered_decode_attention(q, c1, c1, both, mask, s1, s1)
    assert torch.allclose(out.float(), ref.float(), atol=0.02 * ref.abs().max().item())


def test_int8_cache_holds_twice_the_blocks(ckpt):
    def blocks(kv_cache_dtype):
        return Engine(EngineConfig(model=str(ckpt), dtype="bfloat16", kv_cache_gb=0.002,
                                   max_num_seqs=4096, kv_cache_dtype=kv_cache_dtype)
                      ).num_kv_blocks
    full, int8 = blocks("auto"), blocks("int8")
    assert int8 >= 1.95 * full  # (head dim 16 here: 1.97x; 1.99x at 64)


@pytest.mark.parametrize("native_kernels", ["1", "0"])
def test_int8_handoff_equals_single_engine(ckpt, monkeypatch, native_kernels):
    """Prefill on one engine, decode on another: the int8 blocks and their scales move as they
    are, so the tokens equal one engine's (native kernels, and torch's fallback)."""
    monkeypatch.setenv("EVENFLOW_NATIVE_KV_INT8", native_kernels)
    native.kv_int8.cache_clear()
    try:
        cfg = EngineConfig(model=str(ckpt), dtype="float32", block_size=4, kv_cache_dtype="int8")
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        prompts = {"a": list(range(3, 40)), "b": list(range(50, 58))}
        expected, handed_over, kvs = prefill_then_decode(cfg, prompts, params)
        assert all(kv.dtype == "int8" for kv in kvs.values())
        assert handed_over == expected
    finally:
        native.kv_int8.cache_clear()


def test_fp8_is_refused_clearly():
    with pytest.raises(ValueError, match="fp8_e4m3 needs native fp8"):
        EngineConfig(kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match=r"kv_cache_dtype \(EVENFLOW_KV_CACHE_DTYPE\) must be one"):
        EngineConfig(kv_cache_dtype="int4")


def test_an_int8_latent_decodes_as_the_float_one_within_its_rounding(tmp_path):
    """MLA over an int8 latent cache: a decode step reads the prompt's latents back from int8
    (per block scales) and its logits stay within the rounding of the float cache's."""
    from evenflow.engine.runners.model_runner import ChunkInput

    make_checkpoint("deepseek_v3", tmp_path)
    prompt = list(range(3, 33))

    def decode_logits(kv_cache_dtype):
        runner = Engine(EngineConfig(model=str(tmp_path), dtype="float32", block_size=16,
                                     kv_cache_dtype=kv_cache_dtype)).runner
        runner.forward([ChunkInput(prompt, 0, [0, 1, 2], False)])
        return runner.forward([ChunkInput([40], len(prompt), [0, 1, 2], True)])

    want, got = decode_logits("auto"), decode_logits("int8")
    assert (got - want).abs().max() < 0.02 * want.abs().max()
    assert not torch.equal(got, want)  # (it did read the int8 values)
