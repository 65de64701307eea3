"""The MoE families parse_config (config/families.py) maps onto ModelConfig beyond the core ones
(Llama, Qwen, Mistral, Mixtral): one builder per family, from its config.json keys and the
fields every family shares (`common`) to the switches the model files read. Torch-free."""

from __future__ import annotations

import math
from typing import Any

from evenflow.engine.config.settings import ModelConfig, ModelLoadError


def olmoe(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """OLMoE: q/k norms over the whole projections, `clip_qkv`, softmax top-k routing. The
    same mapping serves FlexOlmo, whose norms come after each sublayer (OLMo 2's post-norms)."""
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        **common,
        norm_placement="post" if common["architecture"] == "FlexOlmoForCausalLM" else "pre",
        attention_bias=bias, o_proj_bias=bias, qk_norm=True, qk_norm_whole=True,
        clip_qkv=float(raw["clip_qkv"]) if raw.get("clip_qkv") is not None else None,
        num_experts=int(raw["num_experts"]),
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        sparse_layers=(True,) * common["num_layers"],
    )


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def deepseek(raw: dict[str, Any], common: dict[str, Any], v3: bool) -> ModelConfig:
    """DeepSeek-V2 / -V3: MLA attention, `first_k_dense_replace` dense layers, then DeepSeekMoE
    layers (routed experts plus ungated shared experts). V3 routes by sigmoid scores with a
    score-correction bias and groups ranked by their top-2 sum (`noaux_tc`); V2 by softmax,
    greedy or `group_limited_greedy` (groups ranked by their best expert). As in transformers,
    V2 never renormalizes the top-k weights; both multiply them by routed_scaling_factor."""
    nope, rope_dims = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
    layers, heads = common["num_layers"], common["num_heads"]
    if raw.get("mlp_bias"):
        raise ModelLoadError("DeepSeek-V2 with mlp_bias is not supported")
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    scale = (nope + rope_dims) ** -0.5
    if (params.get("rope_type") or params.get("type") or "default") != "default" and \
            params.get("mscale_all_dim"):
        mscale = _yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= mscale * mscale
    method = raw.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if method not in (("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")):
        raise ModelLoadError(f"topk_method {method!r} is not supported for "
                             f"{common['architecture']}")
    grouped = method != "greedy" and raw.get("n_group")
    common |= dict(num_kv_heads=heads, head_dim=nope + rope_dims)
    return ModelConfig(
        **common,
        attention_bias=bool(raw.get("attention_bias", False)),
        o_proj_bias=bool(raw.get("attention_bias", False)),
        attention_scale=scale,
        kv_lora_rank=int(raw["kv_lora_rank"]), q_lora_rank=int(raw.get("q_lora_rank") or 0),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope_dims, v_head_dim=int(raw["v_head_dim"]),
        rope_interleave=bool(raw.get("rope_interleave", True)) if v3 else True,
        **_deepseek_moe(raw, layers, v3, bool(grouped)),
    )


def _deepseek_moe(raw: dict[str, Any], layers: int, v3: bool, grouped: bool
                  ) -> dict[str, Any]:
    """DeepSeekMoE's ModelConfig fields (DeepSeek-V2 / -V3, and GLM-4.5's V3-style MoE):
    dense first layers, routed experts, ungated shared experts, V3's sigmoid + correction
    bias + top-2-sum groups or V2's softmax + max groups, the scaling factor."""
    experts = int(raw["n_routed_experts"])
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)) if v3 else False,
        shared_expert_intermediate_size=int(raw["moe_intermediate_size"])
        * int(raw.get("n_shared_experts") or 0),
        shared_expert_gated=False,
        sparse_layers=tuple(experts > 0 and i >= first_dense for i in range(layers)),
        router_scoring="sigmoid" if v3 else "softmax",
        score_correction_bias=v3,
        num_expert_groups=int(raw["n_group"]) if grouped else 1,
        topk_groups=int(raw["topk_group"]) if grouped else 1,
        group_scoring="top2_sum" if v3 else "max",
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
    )


def gpt_oss(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """GPT-OSS: q/k/v/o biases, attention sinks, sliding-window layers alternating with full
    ones (`layer_types`), a router with a bias whose top-k logits are softmaxed, experts with
    biases and a clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`)."""
    layers = common["num_layers"]
    bias = bool(raw.get("attention_bias", True))
    return ModelConfig(
        **common,
        attention_bias=bias, o_proj_bias=bias,
        attention_sinks=True,
        num_experts=int(raw["num_local_experts"]),
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["intermediate_size"]),
        norm_topk_prob=False,
        sparse_layers=(True,) * layers,
        router_scoring="softmax_topk",
        router_bias=True,
        expert_bias=True,
        expert_activation="clamped_swiglu",
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
    )


def glm4_moe(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """GLM-4.5 / 4.6 (Glm4Moe): DeepSeek-V3's MoE (sigmoid scores with a correction bias,
    groups, routed_scaling_factor, ungated shared experts, dense first layers) under grouped-query
    attention with partial rotary, q/k/v biases and an optional per-head q/k norm. No layer of
    its own: a mapping onto the parts the other families use. The same mapping serves
    dots.llm1 (Dots1: Qwen3's attention, always with its q/k norm, over DeepSeek-V3's MoE) and
    Solar Open (Llama's attention over GLM-4.5's MoE in every layer)."""
    arch = common["architecture"]
    if arch != "Glm4MoeForCausalLM" and raw.get("layer_types") and any(
            t != "full_attention" for t in raw["layer_types"]):
        raise ModelLoadError(f"{arch} with sliding-window layers is not supported")
    return ModelConfig(
        **common,
        attention_bias=bool(raw.get("attention_bias", False)),
        qk_norm=arch == "Dots1ForCausalLM" or bool(raw.get("use_qk_norm", False)),
        **_deepseek_moe(raw, common["num_layers"], v3=True, grouped=bool(raw.get("n_group"))),
    )


def granite_moe(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """Granite-MoE: Mixtral's layout with four multipliers: the attention's softmax scale
    (`attention_multiplier`), the embedding's, each residual branch's, and the logits' divisor
    (`logits_scaling`); its router softmaxes the top-k logits. The multipliers are folded into
    the weights at load, so no layer changes. Granite-MoE-Shared adds an ungated shared MLP
    (`shared_intermediate_size`, 0: none)."""
    return ModelConfig(
        **common,
        attention_bias=bool(raw.get("attention_bias", False)),
        o_proj_bias=bool(raw.get("attention_bias", False)),
        attention_scale=float(raw.get("attention_multiplier") or 0.0),
        num_experts=int(raw["num_local_experts"]),
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["intermediate_size"]),
        sparse_layers=(True,) * common["num_layers"],
        router_scoring="softmax_topk",
        shared_expert_intermediate_size=int(raw.get("shared_intermediate_size") or 0),
        shared_expert_gated=False,
        embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
        logits_scaling=float(raw.get("logits_scaling", 1.0)),
    )


def dbrx_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """DBRX's config keys (d_model, n_heads, attn_config, ffn_config, ...) as the usual ones
    parse_config reads; attn_config and ffn_config stay for _dbrx."""
    attn, ffn = raw.get("attn_config") or {}, raw.get("ffn_config") or {}
    rope = raw.get("rope_parameters") or {"rope_type": "default",
                                          "rope_theta": attn.get("rope_theta", 10000.0)}
    return {**raw, "hidden_size": raw["d_model"], "num_attention_heads": raw["n_heads"],
            "num_hidden_layers": raw["n_layers"], "max_position_embeddings": raw["max_seq_len"],
            "num_key_value_heads": attn.get("kv_n_heads", 1), "head_dim": None,
            "intermediate_size": ffn["ffn_hidden_size"], "rope_parameters": rope,
            "hidden_act": (ffn.get("ffn_act_fn") or {}).get("name", "silu"),
            "rms_norm_eps": 1e-5}  # (torch's LayerNorm default, which DBRX's norms keep)


def dbrx(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """DBRX: bias-free LayerNorms, one fused q | k | v projection clamped to `clip_qkv`,
    softmax routing whose top-k weights are divided by their p-norm
    (`moe_normalize_expert_weights`: 1 is the renormalization the other families do, none
    none), experts stored row-stacked (loader). A mapping onto the parts the others use."""
    attn, ffn = raw.get("attn_config") or {}, raw.get("ffn_config") or {}
    p = ffn.get("moe_normalize_expert_weights", 1.0)
    if p is not None and float(p) != 1.0:
        raise ModelLoadError(f"DBRX with moe_normalize_expert_weights={p} is not supported "
                             f"(1 or none)")
    return ModelConfig(
        **common,
        norm_kind="layer",
        clip_qkv=float(attn["clip_qkv"]) if attn.get("clip_qkv") is not None else None,
        num_experts=int(ffn.get("moe_num_experts", 4)),
        num_experts_per_tok=int(ffn.get("moe_top_k", 1)),
        moe_intermediate_size=int(ffn["ffn_hidden_size"]),
        norm_topk_prob=p is not None,
        sparse_layers=(True,) * common["num_layers"],
    )


def ernie45_moe(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """Ernie 4.5 MoE: rotary over interleaved pairs (folded into the q and k rows at load),
    MoE layers every `moe_layer_interval` from `moe_layer_start_index` to
    `moe_layer_end_index` (-1: the last), softmax scores with a correction bias added for the
    choice only, the chosen renormalized, ungated shared experts. A mapping onto the parts the
    others use."""
    if raw.get("use_bias"):
        raise ModelLoadError("Ernie 4.5 MoE with use_bias (biases on its MLPs) is not supported")
    layers = common["num_layers"]
    start, end = int(raw.get("moe_layer_start_index", 1)), int(raw.get("moe_layer_end_index", -1))
    end = layers - 1 if end == -1 else end
    step = int(raw.get("moe_layer_interval", 1)) or 1
    experts = int(raw["moe_num_experts"])
    return ModelConfig(
        **common,
        rope_interleave=True,
        num_experts=experts,
        num_experts_per_tok=int(raw["moe_k"]),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        shared_expert_intermediate_size=int(raw["moe_intermediate_size"])
        * int(raw.get("moe_num_shared_experts") or 0),
        shared_expert_gated=False,
        sparse_layers=tuple(experts > 0 and (i + 1) % step == 0 and start <= i <= end
                            for i in range(layers)),
        score_correction_bias=True,
    )


def hunyuan_moe(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """HunYuan-MoE (v1): per-head q/k norms after rotary, softmax top-k routing renormalized,
    an ungated shared MLP as wide as each expert in every layer; its "dynamic" rotary with an
    `alpha` is a fixed base of theta * alpha ** (d / (d - 2))."""
    experts, top_k = raw["num_experts"], raw["moe_topk"]
    if isinstance(experts, list) or isinstance(top_k, list):
        if len(set(experts if isinstance(experts, list) else [experts])) > 1 or \
                len(set(top_k if isinstance(top_k, list) else [top_k])) > 1:
            raise ModelLoadError("HunYuan-MoE with per-layer expert counts or top-k is not "
                                 "supported")
        experts = experts[0] if isinstance(experts, list) else experts
        top_k = top_k[0] if isinstance(top_k, list) else top_k
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if params.get("alpha"):
        d = common["head_dim"]
        common = {**common, "rope_theta": common["rope_theta"] * float(params["alpha"])
                  ** (d / (d - 2))}
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        **common,
        attention_bias=bias, o_proj_bias=bias, qk_norm=True, qk_norm_after_rope=True,
        num_experts=int(experts),
        num_experts_per_tok=int(top_k),
        moe_intermediate_size=common["intermediate_size"],
        shared_expert_intermediate_size=common["intermediate_size"],
        shared_expert_gated=False,
        sparse_layers=(True,) * common["num_layers"],
    )


def minimax_m2(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """MiniMax-M2: OLMoE's q/k norms over the whole projections with partial rotary (released
    configs give `rotary_dim`), DeepSeek-V3's sigmoid scores with a correction bias for the
    choice, renormalized, without groups or scaling. A mapping."""
    params = raw.get("rope_parameters") or {}
    if raw.get("rotary_dim") and "partial_rotary_factor" not in params | raw:
        common = {**common, "partial_rotary": int(raw["rotary_dim"]) / common["head_dim"]}
    return ModelConfig(
        **common,
        qk_norm=True, qk_norm_whole=True,
        num_experts=int(raw["num_local_experts"]),
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=common["intermediate_size"],
        norm_topk_prob=True,
        sparse_layers=(True,) * common["num_layers"],
        router_scoring="sigmoid",
        score_correction_bias=True,
    )


def glm4_moe_lite(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """GLM-4.7-Flash (Glm4MoeLite): DeepSeek-V3's MLA attention over GLM-4.5's MoE, dense
    layers named by `mlp_layer_types`. A mapping: the MLA of _deepseek with the MoE of
    _glm4_moe."""
    layers = common["num_layers"]
    types = raw.get("mlp_layer_types")
    if types:  # ("dense" / "sparse" per layer, in place of first_k_dense_replace)
        first_dense = next((i for i, t in enumerate(types) if t != "dense"), layers)
        if any(t == "dense" for t in types[first_dense:]):
            raise ModelLoadError("Glm4MoeLite with dense layers after sparse ones is not "
                                 "supported")
        raw = {**raw, "first_k_dense_replace": first_dense}
    return deepseek({**raw, "topk_method": "noaux_tc"}, common, v3=True)
