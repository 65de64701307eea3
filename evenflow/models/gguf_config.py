"""A GGUF file's metadata as the config.json of the Hugging Face checkpoint it becomes
(models/gguf_import.py converts the tensors): which llama.cpp architectures are served and as
which HF family, their keys (heads, rope and its scaling, experts and their gating, MLA's ranks,
GPT-OSS's windows), and what is refused by name."""

from __future__ import annotations

from typing import Any


class GGUFError(ValueError):
    """The GGUF file cannot be served (architecture, tensor type, tokenizer)."""


# llama.cpp's architectures served: (HF class, model_type) dense and MoE, whether llama.cpp
# stored Q and K in its interleaved rotary order, and the HF prefix of a layer's experts
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": dict(dense=("LlamaForCausalLM", "llama"), moe=("MixtralForCausalLM", "mixtral"),
                  permuted=True, experts="block_sparse_moe"),
    "qwen2": dict(dense=("Qwen2ForCausalLM", "qwen2"), moe=None, permuted=False, experts=""),
    "qwen3": dict(dense=("Qwen3ForCausalLM", "qwen3"), moe=None, permuted=False, experts=""),
    "qwen3moe": dict(dense=None, moe=("Qwen3MoeForCausalLM", "qwen3_moe"), permuted=False,
                     experts="mlp"),
    # (DeepSeek-V2 where the file's gating is softmax: _deepseek2)
    "deepseek2": dict(dense=None, moe=("DeepseekV3ForCausalLM", "deepseek_v3"), permuted=False,
                      experts="mlp"),
    "gpt-oss": dict(dense=None, moe=("GptOssForCausalLM", "gpt_oss"), permuted=False,
                    experts="mlp"),
}
SOFTMAX, SIGMOID = 1, 2  # GGUF's expert_gating_func


def field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_config(reader: Any, arch: str) -> dict[str, Any]:
    def get(key: str, default: Any = None) -> Any:
        return field(reader, f"{arch}.{key}", default)

    embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    experts = int(get("expert_count", 0) or 0)
    config: dict[str, Any] = {
        "vocab_size": int(get("vocab_size", 0) or embed.shape[-1]),
        "hidden_size": hidden, "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length") or get("rope.dimension_count") or
                        hidden // heads),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
    }
    family = ARCHITECTURES[arch]
    kind = family["moe"] if experts else family["dense"]
    if kind is None:
        raise GGUFError(f"a {arch} GGUF {'with' if experts else 'without'} experts is not served")
    config.update(architectures=[kind[0]], model_type=kind[1])
    if experts:
        used = int(get("expert_used_count"))
        config.update(num_local_experts=experts, num_experts=experts, num_experts_per_tok=used)
    if arch == "qwen3moe":
        config.update(moe_intermediate_size=int(get("expert_feed_forward_length")),
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    scaling = _rope_scaling(get)
    if scaling:
        config["rope_parameters"] = {"rope_theta": config["rope_theta"], **scaling}
    if arch == "deepseek2":
        _deepseek2(get, config)
    if arch == "gpt-oss":
        _gpt_oss(get, config)
    return config


def _rope_scaling(get: Any) -> dict[str, Any]:
    """Hugging Face's rope_parameters (less rope_theta) from the file's rope.scaling.*; {} when
    it has none."""
    kind, factor = get("rope.scaling.type"), get("rope.scaling.factor")
    if kind in (None, "none") or not factor:
        return {}
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind != "yarn":
        raise GGUFError(f"rope scaling {kind!r} is not served (linear and yarn are)")
    params: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor),
                              "original_max_position_embeddings": int(
                                  get("rope.scaling.original_context_length"))}
    for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                    ("yarn_attn_factor", "attention_factor")):
        if get(f"rope.scaling.{key}") is not None:
            params[hf] = float(get(f"rope.scaling.{key}"))
    return params


def _deepseek2(get: Any, config: dict[str, Any]) -> None:
    """DeepSeek-V2 / -V3 from llama.cpp's `deepseek2` keys. Current files state MLA as MQA over
    the latent (head_count_kv 1, key_length kv_lora + rope dims) and the per-head lengths as
    key_length_mla / value_length_mla; older ones state the per-head lengths as key_length /
    value_length. Sigmoid gating is V3 (noaux_tc routing, a correction bias); softmax (also
    llama.cpp's default for files without the key) is V2, its groups limited where the file has
    more than one."""
    rope = int(get("rope.dimension_count"))
    if get("attention.key_length_mla") is not None:
        qk, v = int(get("attention.key_length_mla")), int(get("attention.value_length_mla"))
    else:
        qk, v = int(get("attention.key_length")), int(get("attention.value_length"))
    gating = int(get("expert_gating_func", SOFTMAX) or SOFTMAX)
    if gating not in (SOFTMAX, SIGMOID):
        raise GGUFError(f"deepseek2 expert gating {gating} is not served (softmax and sigmoid "
                        "are)")
    norm = bool(get("expert_weights_norm", False))
    if gating == SOFTMAX and norm:
        raise GGUFError("a deepseek2 GGUF with softmax gating and expert_weights_norm is not "
                        "served (DeepSeek-V2 never renormalizes its top-k weights)")
    groups = int(get("expert_group_count", 1) or 1)
    v3 = gating == SIGMOID
    config.update(
        architectures=["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        model_type="deepseek_v3" if v3 else "deepseek_v2",
        num_key_value_heads=config["num_attention_heads"], head_dim=rope,
        q_lora_rank=int(get("attention.q_lora_rank")) if get("attention.q_lora_rank") else None,
        kv_lora_rank=int(get("attention.kv_lora_rank")), qk_rope_head_dim=rope,
        qk_nope_head_dim=qk - rope, v_head_dim=v, rope_interleave=True,
        n_routed_experts=config["num_experts"],
        n_shared_experts=int(get("expert_shared_count", 0) or 0),
        moe_intermediate_size=int(get("expert_feed_forward_length")),
        first_k_dense_replace=int(get("leading_dense_block_count", 0) or 0),
        routed_scaling_factor=float(get("expert_weights_scale", 1.0) or 1.0),
        norm_topk_prob=norm, n_group=groups,
        topk_group=int(get("expert_group_used_count", 1) or 1),
        topk_method="noaux_tc" if v3 else "group_limited_greedy" if groups > 1 else "greedy",
        scoring_func="sigmoid" if v3 else "softmax")
    params = config.get("rope_parameters")
    log_mul = get("rope.scaling.yarn_log_multiplier")
    if params and params["rope_type"] == "yarn" and log_mul:
        # llama.cpp stores 0.1 * mscale_all_dim (its converter's note: for legacy reasons);
        # DeepSeek's mscale equals it
        params["mscale"] = params["mscale_all_dim"] = round(float(log_mul) / 0.1, 6)


def _gpt_oss(get: Any, config: dict[str, Any]) -> None:
    """GPT-OSS: what llama.cpp fixes for the architecture (even layers sliding, SwiGLU clamped at
    7 with alpha 1.702, YaRN without truncation) stated in Hugging Face's keys."""
    layers = config["num_hidden_layers"]
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        sliding = [bool(x) for x in pattern]
    else:
        n = int(pattern or 2)
        sliding = [i % n < n - 1 for i in range(layers)]
    config.update(
        intermediate_size=int(get("expert_feed_forward_length", config["intermediate_size"])),
        sliding_window=int(get("attention.sliding_window")),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        attention_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702)
    if config.get("rope_parameters", {}).get("rope_type") == "yarn":
        config["rope_parameters"]["truncate"] = False
