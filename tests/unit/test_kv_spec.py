"""The KV cache's form decided once (engine/model/kv_spec.py): the bytes the engine budgets a
block at are the bytes the runner allocates for it and the bytes a block takes on the wire,
for K/V and MLA's latent, in the model's dtype and in int8 with its scales; an unknown or
unsupported cache dtype is refused by name."""

from __future__ import annotations

import pytest
import torch

from evenflow.engine.config.families import parse_config
from evenflow.engine.model.kv_spec import KVCacheSpec

BASE = dict(vocab_size=32, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024)
MLA = dict(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
           v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           first_k_dense_replace=1, n_group=1, topk_group=1)


def config(arch: str, **extra):
    return parse_config({"architectures": [arch], **BASE, **extra})


@pytest.mark.parametrize("arch, extra", [("LlamaForCausalLM", {}),
                                         ("DeepseekV3ForCausalLM", MLA)])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_budget_allocation_and_wire_agree(arch, extra, kv_cache_dtype):
    cfg = config(arch, **extra)
    spec = KVCacheSpec.of(cfg, block_size=16, compute=torch.bfloat16,
                          kv_cache_dtype=kv_cache_dtype)
    assert spec.quantized == (kv_cache_dtype == "int8")
    assert spec.name == ("int8" if spec.quantized else "bfloat16")
    assert spec.num_parts == (1 if cfg.mla else 2)
    blocks = 5
    caches = spec.allocate(blocks)
    assert len(caches) == cfg.num_layers
    allocated = sum(t.numel() * t.element_size() for layer in caches for t in layer)
    # each value tensor has one null slot past the blocks, each scale tensor one null row
    null = sum(t[-1:].numel() * t.element_size() for layer in caches for t in layer)
    assert allocated - null == blocks * spec.bytes_per_block
    for layer in caches:  # the null slot reads as zeros (padded attention positions)
        assert all(not t[-1].any() for t in layer)
    wire = torch.Size(spec.transfer_shape(blocks)).numel() * spec.dtype.itemsize
    assert wire == blocks * spec.bytes_per_block


def test_int8_halves_a_bf16_block_but_for_its_scales():
    cfg = config("LlamaForCausalLM")
    bf16 = KVCacheSpec.of(cfg, 16, torch.bfloat16, "auto").bytes_per_block
    int8 = KVCacheSpec.of(cfg, 16, torch.bfloat16, "int8").bytes_per_block
    scales = cfg.num_layers * 2 * cfg.num_kv_heads * 4
    assert int8 == bf16 // 2 + scales


def test_a_rank_holds_its_own_kv_heads():
    cfg = config("LlamaForCausalLM")
    whole = KVCacheSpec.of(cfg, 16, torch.float32, "auto")
    rank = KVCacheSpec.of(cfg, 16, torch.float32, "auto", kv_heads=1)
    assert rank.bytes_per_block * 2 == whole.bytes_per_block


@pytest.mark.parametrize("kv_cache_dtype, says", [("fp16", "must be one of"),
                                                  ("fp8_e4m3", "native fp8")])
def test_unsupported_cache_dtypes_are_refused_by_name(kv_cache_dtype, says):
    with pytest.raises(ValueError, match=says):
        KVCacheSpec.of(config("LlamaForCausalLM"), 16, torch.bfloat16, kv_cache_dtype)
