"""config.json -> ModelConfig for the families and rope scalings the engine implements; what it
does not implement is refused with a message naming it."""

from __future__ import annotations

import math

import pytest

from evenflow.engine.config import ModelLoadError
from evenflow.engine.families import parse_config

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


def test_a_sliding_window_caps_the_context_where_full_attention_is_exact():
    assert parse("MistralForCausalLM", sliding_window=256).max_position_embeddings == 256
    assert parse("MistralForCausalLM", sliding_window=None).max_position_embeddings == 1024
    assert parse("Qwen2ForCausalLM", sliding_window=128,
                 use_sliding_window=False).max_position_embeddings == 1024


def test_qwen2_has_qkv_biases_and_olmoe_normalizes_whole_projections():
    assert parse("Qwen2ForCausalLM").attention_bias
    olmoe = parse("OlmoeForCausalLM", num_experts=8, num_experts_per_tok=2, clip_qkv=4.0)
    assert olmoe.qk_norm and olmoe.qk_norm_whole and olmoe.clip_qkv == 4.0 and olmoe.is_moe
