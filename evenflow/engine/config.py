"""Engine and model configuration, torch-free (services build an EngineConfig without torch).

EngineConfig: how one engine runs (dtype, cache size, batching); the mesh's defaults for these
settings are this class's defaults (services/config.py reads them from here). ModelConfig: read
from a Hugging Face config.json, for the architectures we implement.

One frozen dataclass covers Llama, Qwen2, Qwen3, Mistral (dense) and Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE: the differences are switches (q/k norm per head or over the projection, qkv
bias, clip_qkv, shared expert, top-k renormalisation, which layers are sparse, rope scaling)
read here once, so the model files have no per-architecture branches.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evenflow import models

DTYPES = ("float32", "bfloat16", "float16")
# engine/quant/stacks.py implements them (this module is torch-free)
QUANT_METHODS = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class EngineSwitch:
    """A process-wide engine switch, read from the environment (`EVENFLOW_<NAME>`): the same
    offline, under `evenflow up`, Ray Serve and compose (services/config.py carries them to the
    workers). `evenflow up --help-env` lists them."""

    name: str  # the environment variable
    default: str
    help: str
    on_off: bool = True  # 1/0, true/false, on/off; else any string (NATIVE_MARCH)


ENGINE_SWITCHES: dict[str, EngineSwitch] = {s.name: s for s in (
    EngineSwitch("EVENFLOW_NATIVE_KERNELS", "1", "the engine's own C++ kernels (0: torch's "
                 "kernels everywhere)"),
    EngineSwitch("EVENFLOW_NATIVE_MARCH", "native", "the GCC -march the kernels are built for "
                 "(e.g. haswell: an AVX2 machine's code paths)", on_off=False),
    EngineSwitch("EVENFLOW_NATIVE_NORM", "1", "fused RMSNorm + residual add"),
    EngineSwitch("EVENFLOW_NATIVE_ROTARY", "1", "the decode step's fused rotary + KV write"),
    EngineSwitch("EVENFLOW_NATIVE_ATTENTION", "1", "paged decode attention"),
    EngineSwitch("EVENFLOW_NATIVE_PREFILL_ATTENTION", "1", "causal prefill attention over the "
                 "paged cache"),
    EngineSwitch("EVENFLOW_NATIVE_KV_BLOCKS", "1", "the K/V hand-off's block copies"),
    EngineSwitch("EVENFLOW_NATIVE_MOE", "1", "the fused routed-experts kernel"),
    EngineSwitch("EVENFLOW_NATIVE_LINEAR", "1", "dense linears over panel-packed weights"),
    EngineSwitch("EVENFLOW_NATIVE_ROUTING", "1", "MoE routing (softmax, top-k) in one call"),
    EngineSwitch("EVENFLOW_FAST_DECODE", "1", "a decode step's layers as one native call"),
)}
_OFF = ("0", "false", "off", "no")


def check_engine_switch(name: str, raw: str) -> str:
    """The switch's value, checked (ValueError names the variable)."""
    switch = ENGINE_SWITCHES[name]
    if switch.on_off and raw.lower() not in _OFF + ("1", "true", "on", "yes"):
        raise ValueError(f"{name} must be 1 or 0 (true/false, on/off), not {raw!r}")
    if not raw:
        raise ValueError(f"{name} is empty")
    return raw


def engine_switch(name: str) -> str:
    """The one reader of the engine's switches: the environment's value, else the default."""
    raw = os.environ.get(name)
    return ENGINE_SWITCHES[name].default if raw is None else check_engine_switch(name, raw)


def switched_on(name: str) -> bool:
    return engine_switch(name).lower() not in _OFF


@functools.cache
def cpu_description() -> str:
    """The first processor's /proc/cpuinfo block (model name, flags, ...); "" where there is
    none. Read once per process."""
    try:
        return Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return ""


def cpu_has_bf16() -> bool:
    flags = cpu_description()
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass(frozen=True)
class EngineConfig:
    model: str = models.DEFAULT_MODEL
    dtype: str = "auto"  # auto: bfloat16 where the CPU has native bf16 math, else float32
    block_size: int = 16
    num_kv_blocks: int | None = None  # default: as many as kv_cache_gb holds (capped below)
    kv_cache_gb: float = 0.5
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's, at most 8192
    num_threads: int | None = None  # torch intra-op threads; None keeps torch's choice
    enable_prefix_caching: bool = True
    # A request whose next block another request is computing waits a step and hits the cache
    # (a burst sharing a new prefix computes it once); off only to measure what it saves.
    defer_shared_prefill: bool = True
    # Expert parallelism (virtual ranks inside this process): 0 ranks = no placement; slots =
    # experts + redundant slots for replicas of hot experts, spread evenly over the ranks.
    num_ep_ranks: int = 0
    num_redundant_experts: int = 0
    # Weight-only quantization at load (engine/quant/stacks.py): None, "int8" (per output channel)
    # or "int4" (groups of quant_group_size input channels, with zero points unless symmetric).
    # A GPTQ checkpoint is loaded quantized as it is, whatever this says.
    quantization: str | None = None
    quant_group_size: int = 64
    quant_symmetric: bool = False
    quantize_lm_head: bool = False
    # Tensor parallelism: this many rank processes on this host, each holding 1/N of every
    # layer's heads and MLP/expert columns (engine/tensor_parallel.py). Rank 0 is this process.
    # num_threads is then per rank (default: cores / N).
    tensor_parallel_size: int = 1
    # Expert parallelism with data-parallel attention (engine/dep/offline.py, offline LLM only
    # for now): N lockstep rank processes, each with its own requests and KV cache, each
    # computing its share of the expert slots; implies num_ep_ranks = N.
    expert_parallel_size: int = 1
    show_progress: bool = False  # a loading bar on stderr (the offline API: on a terminal)
    # Reorder float weights once into oneDNN's blocked layout (engine/weights/prepack.py): decode's
    # skinny matmuls read them up to 2x faster; False keeps plain nn.Linear (for comparisons).
    prepack_weights: bool = True

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {list(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_kv_blocks", "max_model_len", "num_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 (or unset), got {value}")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.num_ep_ranks < 0 or self.num_redundant_experts < 0:
            raise ValueError("num_ep_ranks and num_redundant_experts must be >= 0")
        if self.quantization is not None:
            check_quantization(self.quantization, self.quant_group_size)
        if self.tensor_parallel_size < 1 or self.expert_parallel_size < 1:
            raise ValueError("tensor_parallel_size and expert_parallel_size must be >= 1")
        if self.tensor_parallel_size > 1 and self.expert_parallel_size > 1:
            raise ValueError("tensor and expert parallelism together are not supported yet")


def check_quantization(method: str, group_size: int) -> None:
    """ValueError unless engine/quant/stacks.py implements `method` with this (int4) group size."""
    if method not in QUANT_METHODS:
        raise ValueError(f"quantization must be one of {list(QUANT_METHODS)}, got {method!r}")
    if method == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size (quant_group_size) must be one of "
                         f"{list(INT4_GROUP_SIZES)}, got {group_size}")


class ModelLoadError(ValueError):
    """The checkpoint cannot be served: unknown architecture, missing or corrupt files."""


SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
)
# Dense decoders that differ only in switches read below.
_DENSE = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are scaled (transformers' rope_parameters / rope_scaling):
    default, linear (positions / factor), llama3 (Llama 3.1's smoothed low-frequency scaling),
    yarn (NTK-by-parts, with its attention scale on cos and sin); dynamic NTK equals default
    within max_position_embeddings, which is the engine's context limit."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3, yarn
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn
    attention_factor: float = 1.0  # cos and sin are multiplied by it (yarn's mscale)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False
    qk_norm: bool = False  # RMSNorm on q and k: per head (Qwen3), or over the whole projection
    qk_norm_whole: bool = False  # (OLMoE)
    clip_qkv: float | None = None  # q, k and v clamped to [-clip, clip] (OLMoE)
    rope: RopeScaling = field(default_factory=RopeScaling)
    # MoE; num_experts == 0 means dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    sparse_layers: tuple[bool, ...] = field(default=())  # per layer: MoE (True) or dense MLP
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "heads must be a multiple of KV heads"
        assert len(self.sparse_layers) == self.num_layers
        if self.num_experts:
            assert 0 < self.num_experts_per_tok <= self.num_experts

    @property
    def is_moe(self) -> bool:
        return any(self.sparse_layers)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.sparse_layers)


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
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError("partial rotary embeddings are not supported")
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


def _context_limit(raw: dict[str, Any], arch: str) -> int:
    """max_position_embeddings, capped by a sliding window that the engine does not implement:
    within the window, full attention is exact."""
    limit = int(raw.get("max_position_embeddings", 4096))
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", arch == "MistralForCausalLM")
    if window and uses_window:
        limit = min(limit, int(window))
    return limit


def parse_config(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """Map a config.json dict onto ModelConfig; raises ModelLoadError naming what is wrong."""
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"unsupported architecture {archs or raw.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        layers = int(raw["num_hidden_layers"])
        theta, rope = _rope(raw)
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"activation {act!r} is not supported (silu only)")
        common: dict[str, Any] = dict(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw.get("intermediate_size", 0)),
            max_position_embeddings=_context_limit(raw, arch),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope=rope,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=_eos_ids((generation or {}).get("eos_token_id"), raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
        )
        if arch in _DENSE:
            return ModelConfig(
                **common,
                # Qwen2: q/k/v biases always
                attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias")),
                qk_norm=arch == "Qwen3ForCausalLM",
                sparse_layers=(False,) * layers,
            )
        if arch == "OlmoeForCausalLM":
            bias = bool(raw.get("attention_bias", False))
            return ModelConfig(
                **common,
                attention_bias=bias, o_proj_bias=bias, qk_norm=True, qk_norm_whole=True,
                clip_qkv=float(raw["clip_qkv"]) if raw.get("clip_qkv") is not None else None,
                num_experts=int(raw["num_experts"]),
                num_experts_per_tok=int(raw["num_experts_per_tok"]),
                moe_intermediate_size=int(raw["intermediate_size"]),
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                sparse_layers=(True,) * layers,
            )
        if arch == "MixtralForCausalLM":
            return ModelConfig(
                **common,
                num_experts=int(raw["num_local_experts"]),
                num_experts_per_tok=int(raw["num_experts_per_tok"]),
                moe_intermediate_size=int(raw["intermediate_size"]),
                norm_topk_prob=True,
                sparse_layers=(True,) * layers,
            )
        # Qwen2-MoE / Qwen3-MoE: some layers may be dense
        experts = int(raw.get("num_experts", raw.get("num_local_experts", 0)))
        step = int(raw.get("decoder_sparse_step", 1)) or 1
        dense_only = set(raw.get("mlp_only_layers") or [])
        sparse = tuple(
            i not in dense_only and experts > 0 and (i + 1) % step == 0 for i in range(layers)
        )
        qwen2 = arch == "Qwen2MoeForCausalLM"
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
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks {exc.args[0]!r} for {arch}") from exc
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ModelLoadError):
            raise
        raise ModelLoadError(f"config.json has a bad value: {exc}") from exc


def load_config(model_dir: str | Path) -> ModelConfig:
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
