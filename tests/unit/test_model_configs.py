"""config.json -> ModelConfig for the families and rope scalings the engine implements; what it
does not implement is refused with a message naming it."""

from __future__ import annotations

import math

import pytest

from evenflow.engine.config.families import parse_config
from evenflow.engine.config.settings import ModelLoadError

BASE = dict(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024)


def parse(arch: str, **extra):
    return parse_config({"architectures": [arch], **BASE, **extra})


def test_llama3_rope_and_yarn_scale_as_configured():
    cfg = parse("LlamaForCausalLM", rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192), rope_theta=500000.0)
    assert cfg.rope.rope_type == "llama3" and cfg.rope_theta == 500000.0
    yarn = parse("Qwen3ForCausalLM", rope_parameters=dict(
        rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=256))
    assert yarn.rope.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)


def test_dynamic_rope_is_default_within_the_context():
    cfg = parse("LlamaForCausalLM", rope_scaling=dict(type="dynamic", factor=2.0))
    assert cfg.rope.rope_type == "default"


@pytest.mark.parametrize("rope, message", [
    (dict(rope_type="longrope", factor=2.0), "'longrope' is not supported"),
    (dict(rope_type="linear"), "needs a factor"),
])
def test_unsupported_rope_is_refused_by_name(rope, message):
    with pytest.raises(ModelLoadError, match=message):
        parse("LlamaForCausalLM", rope_scaling=rope)


def test_sliding_windows_run_windowed_on_the_layers_transformers_gives_them():
    """The context is the model's own: each layer keeps its window (no cap)."""
    mistral = parse("MistralForCausalLM", sliding_window=256)
    assert mistral.max_position_embeddings == 1024 and set(mistral.layer_windows) == {256}
    assert parse("MistralForCausalLM", sliding_window=None).layer_windows == ()
    assert parse("Qwen2ForCausalLM", sliding_window=128,
                 use_sliding_window=False).layer_windows == ()
    qwen2 = parse("Qwen2ForCausalLM", sliding_window=128, use_sliding_window=True,
                  layer_types=["full_attention", "sliding_attention"])
    assert qwen2.layer_windows == (0, 128) and qwen2.max_position_embeddings == 1024


def test_qwen2_has_qkv_biases_and_olmoe_normalizes_whole_projections():
    assert parse("Qwen2ForCausalLM").attention_bias
    olmoe = parse("OlmoeForCausalLM", num_experts=8, num_experts_per_tok=2, clip_qkv=4.0)
    assert olmoe.qk_norm and olmoe.qk_norm_whole and olmoe.clip_qkv == 4.0 and olmoe.is_moe


DEEPSEEK = dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                moe_intermediate_size=32, kv_lora_rank=64, q_lora_rank=None,
                qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=24,
                first_k_dense_replace=1, n_shared_experts=2)


def test_deepseek_v3_maps_onto_mla_and_deepseekmoe():
    cfg = parse("DeepseekV3ForCausalLM", **DEEPSEEK, routed_scaling_factor=2.5)
    assert cfg.mla and cfg.kv_parts() == ((1, 64 + 16),) and cfg.rotary_dim == 16
    assert cfg.sparse_layers == (False, True)
    assert cfg.shared_expert_intermediate_size == 64 and not cfg.shared_expert_gated
    assert (cfg.router_scoring, cfg.num_expert_groups, cfg.topk_groups, cfg.group_scoring) == (
        "sigmoid", 4, 2, "top2_sum")
    assert cfg.score_correction_bias and cfg.routed_scaling_factor == 2.5
    assert cfg.scale == pytest.approx(48**-0.5)
    # YaRN with mscale_all_dim: the softmax scale grows by mscale squared
    yarn = parse("DeepseekV3ForCausalLM", **DEEPSEEK, rope_parameters=dict(
        rope_type="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0,
        original_max_position_embeddings=4096, rope_theta=10000.0))
    mscale = 0.1 * math.log(40.0) + 1.0
    assert yarn.scale == pytest.approx(48**-0.5 * mscale**2)
    assert yarn.rope.attention_factor == pytest.approx(1.0)  # mscale / mscale_all_dim


def test_deepseek_v2_routes_by_softmax_and_refuses_what_it_lacks():
    v2 = parse("DeepseekV2ForCausalLM", **DEEPSEEK, topk_method="group_limited_greedy")
    assert v2.router_scoring == "softmax" and v2.group_scoring == "max"
    assert not v2.norm_topk_prob and not v2.score_correction_bias
    assert parse("DeepseekV2ForCausalLM", **DEEPSEEK).num_expert_groups == 1  # greedy
    with pytest.raises(ModelLoadError, match="topk_method 'bogus'"):
        parse("DeepseekV2ForCausalLM", **DEEPSEEK, topk_method="bogus")


def test_gpt_oss_alternates_windows_and_glm4_moe_rotates_part_of_each_head():
    oss = parse("GptOssForCausalLM", num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    assert oss.layer_windows == (8, 0) and oss.attention_sinks and oss.expert_bias
    assert oss.router_scoring == "softmax_topk" and oss.expert_activation == "clamped_swiglu"
    glm = parse("Glm4MoeForCausalLM", **{k: v for k, v in DEEPSEEK.items() if "lora" not in k
                                          and "head_dim" not in k},
                head_dim=32, rope_parameters=dict(rope_theta=1e4, partial_rotary_factor=0.5))
    assert not glm.mla and glm.rotary_dim == 16 and glm.router_scoring == "sigmoid"
