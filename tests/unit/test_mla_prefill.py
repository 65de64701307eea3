"""MLA's prefill (engine/model/mla.py, the expanded form) on the native causal prefill kernel
(kernels/prefill_attention.cpp) gives what torch's scaled_dot_product_attention gives: a whole
prompt, and a chunk after a cached prefix; V narrower than the query heads (zero-padded) and as
wide; and the runner picks the kernel only for head widths it serves."""

from __future__ import annotations

import pytest
import torch

from evenflow.engine.config.settings import ModelConfig
from evenflow.engine.kernels import native
from evenflow.engine.model.mla import LatentAttention


def mla_layer(nope: int, rope: int, v_dim: int, dtype: torch.dtype) -> LatentAttention:
    cfg = ModelConfig(architecture="test", vocab_size=32, hidden_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=4, head_dim=nope + rope, intermediate_size=64,
                      max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=1e4,
                      sparse_layers=(False,), kv_lora_rank=32, qk_nope_head_dim=nope,
                      qk_rope_head_dim=rope, v_head_dim=v_dim)
    torch.manual_seed(0)
    layer = LatentAttention(cfg)
    for p in layer.parameters():
        p.data.normal_(0, 0.3)
    return layer.to(dtype)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("v_dim", [32, 64])
@pytest.mark.parametrize("ctx_len, q_len", [(150, 150), (200, 70)],
                         ids=["prompt", "chunk-after-prefix"])
def test_native_prefill_matches_torchs_attention(dtype, tolerance, v_dim, ctx_len, q_len):
    kernel = native.prefill_attention()
    if kernel is None or not native.prefill_attention_serves(dtype, 64, 1):
        pytest.skip("the native prefill attention does not serve this dtype here")
    layer = mla_layer(48, 16, v_dim, dtype)
    g = torch.Generator().manual_seed(1)
    q_nope = torch.randn(q_len, 4, 48, generator=g).to(dtype)
    q_pe = torch.randn(q_len, 4, 16, generator=g).to(dtype)
    ctx = torch.randn(ctx_len, 1, 32 + 16, generator=g).to(dtype)
    offset = ctx_len - q_len
    want = layer._prefill(q_nope, q_pe, ctx, offset).float()
    layer.prefill_kernel = kernel
    got = layer._prefill(q_nope, q_pe, ctx, offset)
    assert got.shape == (q_len, 4, v_dim) and got.dtype == dtype
    assert (got.float() - want).abs().max() <= tolerance * want.abs().max()


def test_a_deepseek_model_on_it_generates_what_transformers_generates(tmp_path):
    """End to end in float32: heads of 48 + 16 take the kernel (a whole prompt, then a prompt
    whose cached prefix makes its prefill a chunk after it); heads of 16 + 16 keep torch's."""
    from checkpoints import VOCAB, hf_greedy, make_checkpoint

    from evenflow import LLM, SamplingParams

    if native.prefill_attention() is None or not native.prefill_attention_serves(
            torch.float32, 64, 1):
        pytest.skip("the native prefill attention does not serve float32 here")
    hf = make_checkpoint("deepseek_v3", tmp_path / "wide", overrides=dict(
        qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=32))
    hf.generation_config.eos_token_id = None
    make_checkpoint("deepseek_v3", tmp_path / "narrow")
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, VOCAB, (40,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (30, 9)]
    llm = LLM(model=str(tmp_path / "wide"), dtype="float32", block_size=8)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, LatentAttention)]
    assert layers and all(m.prefill_kernel is not None for m in layers)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first, second = (llm.generate([p], params)[0] for p in prompts)
    assert second.num_cached_tokens == 40  # (a chunk after the cached prefix)
    for prompt, out in zip(prompts, (first, second), strict=True):
        assert out.token_ids == hf_greedy(hf, prompt, 12)
    narrow = LLM(model=str(tmp_path / "narrow"), dtype="float32")
    assert all(m.prefill_kernel is None for m in narrow.engine.model.modules()
               if isinstance(m, LatentAttention))
