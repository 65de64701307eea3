"""config.json -> ModelConfig: the one place that knows each family's config keys, torch-free.

Families: Llama (also Llama 3's rope), Qwen2, Qwen3, Mistral (dense); Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, DeepSeek-V2 and -V3 (MLA, DeepSeekMoE; also DeepSeek-R1 and Kimi K2, which
are DeepSeek-V3 by architecture), GPT-OSS and GLM-4.5 (Glm4Moe: a mapping only, no layer
of its own), and more by mapping: Dots1, Solar Open, GLM-4.7-Flash, Granite-MoE(-Shared),
FlexOlmo, DBRX, Ernie 4.5 MoE, HunYuan-MoE, MiniMax-M2. Each maps onto ModelConfig's
switches, so the model files have no per-family branches; what the engine does not implement is
refused with a ModelLoadError naming it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from evenflow.engine.config.family_maps import (
    dbrx,
    dbrx_keys,
    deepseek,
    ernie45_moe,
    glm4_moe,
    glm4_moe_lite,
    gpt_oss,
    granite_moe,
    hunyuan_moe,
    minimax_m2,
    olmoe,
)
from evenflow.engine.config.settings import ModelConfig, ModelLoadError, RopeScaling

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "GptOssForCausalLM",
    "Glm4MoeForCausalLM",
    "Glm4MoeLiteForCausalLM",
    "Dots1ForCausalLM",
    "SolarOpenForCausalLM",
    "GraniteMoeForCausalLM",
    "GraniteMoeSharedForCausalLM",
    "FlexOlmoForCausalLM",
    "DbrxForCausalLM",
    "Ernie4_5_MoeForCausalLM",
    "HunYuanMoEV1ForCausalLM",
    "MiniMaxM2ForCausalLM",
)
# Dense decoders that differ only in switches read below.
_DENSE = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")



# MoE families transformers builds that the engine refuses, and why: each needs a layer the engine
# does not have (not a mapping onto the parts it has).
REFUSED_ARCHITECTURES = {
    "Qwen3NextForCausalLM": "its Gated DeltaNet linear-attention layers",
    "Qwen3_5MoeForCausalLM": "its Gated DeltaNet linear-attention layers",
    "KimiLinearForCausalLM": "its Kimi Delta Attention (linear attention) layers",
    "MiniMaxForCausalLM": "its lightning (linear) attention layers",
    "JambaForCausalLM": "its Mamba layers",
    "GraniteMoeHybridForCausalLM": "its Mamba layers",
    "Lfm2MoeForCausalLM": "its short-convolution layers",
    "DeepseekV32ForCausalLM": "its sparse attention (the DSA lightning indexer)",
    "GlmMoeDsaForCausalLM": "its sparse attention (the DSA lightning indexer)",
    "JetMoeForCausalLM": "its mixture of attention heads",
    "LongcatFlashForCausalLM": "its zero-computation experts and shortcut-connected MoE",
    "Llama4ForCausalLM": "its chunked local attention and no-rope layers",
    "PhimoeForCausalLM": "its SparseMixer routing",
    "NllbMoeForConditionalGeneration": "it is an encoder-decoder model",
    "SwitchTransformersForConditionalGeneration": "it is an encoder-decoder model",
    "AfmoeForCausalLM": "its gated attention (a sigmoid gate on each head's output)",
    "MiniCPM5MoeForCausalLM": "its gated attention (a sigmoid gate on each head's output)",
    "Cohere2MoeForCausalLM": "its parallel attention and MLP block and no-rope global layers",
    "ExaoneMoeForCausalLM": "its no-rope global layers between sliding-window ones",
}


def _eos_ids(*values: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for value in values:
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids.extend(v for v in value if isinstance(v, int))
    return tuple(dict.fromkeys(ids))


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling]:
    """(theta, scaling) from rope_parameters (transformers 5) or rope_scaling (older)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type in ("default", "dynamic"):
        return theta, RopeScaling()
    if rope_type not in ("linear", "llama3", "yarn"):
        raise ModelLoadError(f"rope scaling type {rope_type!r} is not supported "
                             f"(default, linear, dynamic, llama3, yarn)")
    original = int(params.get("original_max_position_embeddings")
                   or raw.get("max_position_embeddings", 0))
    given_factor = params.get("factor")
    if given_factor is None and rope_type != "yarn":
        raise ModelLoadError(f"rope scaling {rope_type!r} needs a factor")
    # (without a factor, YaRN's is the ratio of the lengths, as DeepSeek-V3's config states them)
    factor = float(given_factor if given_factor is not None
                   else raw["max_position_embeddings"] / original)
    attention = 1.0
    if rope_type == "yarn":
        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        given, mscale, all_dim = (params.get("attention_factor"), params.get("mscale"),
                                  params.get("mscale_all_dim"))
        if given is not None:
            attention = float(given)
        elif mscale and all_dim:
            attention = float(get_mscale(factor, mscale) / get_mscale(factor, all_dim))
        else:
            attention = get_mscale(factor)
    return theta, RopeScaling(
        rope_type=rope_type, factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)), attention_factor=attention)


def _layer_windows(raw: dict[str, Any], arch: str, layers: int) -> tuple[int, ...]:
    """Each layer's sliding window in tokens (0: full attention; () when none has one), as
    transformers' modeling reads the config: `layer_types` where the config lists them
    (Qwen2, Qwen3, GPT-OSS, ...), else every layer where `sliding_window` is set and not switched
    off by `use_sliding_window` (Mistral, Mixtral, Qwen3-MoE); GPT-OSS alternates by default."""
    window = int(raw.get("sliding_window") or 0)
    if not window:
        return ()
    types = raw.get("layer_types")
    if types is None and arch == "GptOssForCausalLM":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if types is None:
        if raw.get("use_sliding_window") is False:
            return ()
        types = ["sliding_attention"] * layers
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def parse_config(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """Map a config.json dict onto ModelConfig; raises ModelLoadError naming what is wrong."""
    arch = _architecture(raw)
    try:
        if arch == "DbrxForCausalLM":
            raw = dbrx_keys(raw)
        return _BUILDERS.get(arch, _qwen_moe)(raw, _common(raw, arch, generation))
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks {exc.args[0]!r} for {arch}") from exc
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ModelLoadError):
            raise
        raise ModelLoadError(f"config.json has a bad value: {exc}") from exc


def _architecture(raw: dict[str, Any]) -> str:
    """The first supported architecture config.json names; ModelLoadError for a refused one
    (naming the layer the engine lacks) or an unknown one."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    refused = next((a for a in archs if a in REFUSED_ARCHITECTURES), None)
    if arch is None and refused is not None:
        raise ModelLoadError(f"architecture {refused} is not supported: the engine has no layer "
                             f"for {REFUSED_ARCHITECTURES[refused]}")
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs or raw.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _common(raw: dict[str, Any], arch: str, generation: dict[str, Any] | None
            ) -> dict[str, Any]:
    """The ModelConfig keys every family shares."""
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    layers = int(raw["num_hidden_layers"])
    theta, rope = _rope(raw)
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"activation {act!r} is not supported (silu only)")
    return dict(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        intermediate_size=int(raw.get("intermediate_size", 0)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        layer_windows=_layer_windows(raw, arch, layers),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope=rope,
        partial_rotary=_partial_rotary(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_ids=_eos_ids((generation or {}).get("eos_token_id"), raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id"),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
    )


def _dense(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    arch = common["architecture"]
    return ModelConfig(
        **common,
        # Qwen2: q/k/v biases always
        attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias")),
        qk_norm=arch == "Qwen3ForCausalLM",
        sparse_layers=(False,) * common["num_layers"],
    )


def _mixtral(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    return ModelConfig(
        **common,
        num_experts=int(raw["num_local_experts"]),
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["intermediate_size"]),
        norm_topk_prob=True,
        sparse_layers=(True,) * common["num_layers"],
    )


def _qwen_moe(raw: dict[str, Any], common: dict[str, Any]) -> ModelConfig:
    """Qwen2-MoE / Qwen3-MoE: some layers may be dense."""
    experts = int(raw.get("num_experts", raw.get("num_local_experts", 0)))
    step = int(raw.get("decoder_sparse_step", 1)) or 1
    dense_only = set(raw.get("mlp_only_layers") or [])
    sparse = tuple(
        i not in dense_only and experts > 0 and (i + 1) % step == 0
        for i in range(common["num_layers"])
    )
    qwen2 = common["architecture"] == "Qwen2MoeForCausalLM"
    return ModelConfig(
        **common,
        attention_bias=qwen2 or bool(raw.get("attention_bias", False)),
        qk_norm=not qwen2,
        num_experts=experts,
        num_experts_per_tok=int(raw["num_experts_per_tok"]),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=(
            int(raw.get("shared_expert_intermediate_size", 0)) if qwen2 else 0
        ),
        sparse_layers=sparse,
    )


# architecture -> its ModelConfig from (config.json, the common keys); Qwen-MoE otherwise
_BUILDERS: dict[str, Callable[[dict[str, Any], dict[str, Any]], ModelConfig]] = {
    **{arch: _dense for arch in _DENSE},
    "OlmoeForCausalLM": olmoe,
    "FlexOlmoForCausalLM": olmoe,
    "DeepseekV2ForCausalLM": lambda raw, common: deepseek(raw, common, False),
    "DeepseekV3ForCausalLM": lambda raw, common: deepseek(raw, common, True),
    "GptOssForCausalLM": gpt_oss,
    "Glm4MoeForCausalLM": glm4_moe,
    "SolarOpenForCausalLM": glm4_moe,
    "Dots1ForCausalLM": glm4_moe,
    "Glm4MoeLiteForCausalLM": glm4_moe_lite,
    "GraniteMoeForCausalLM": granite_moe,
    "GraniteMoeSharedForCausalLM": granite_moe,
    "DbrxForCausalLM": dbrx,
    "Ernie4_5_MoeForCausalLM": ernie45_moe,
    "HunYuanMoEV1ForCausalLM": hunyuan_moe,
    "MiniMaxM2ForCausalLM": minimax_m2,
    "MixtralForCausalLM": _mixtral,
}


def load_model_config(model_dir: str | Path) -> ModelConfig:
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir}: config.json is missing")
    try:
        raw = json.loads(path.read_text())
        gen_path = model_dir / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    except ValueError as exc:
        raise ModelLoadError(f"{model_dir}: invalid JSON in config ({exc})") from exc
    return parse_config(raw, generation)


def _partial_rotary(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    return float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
