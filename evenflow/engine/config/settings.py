"""Engine and model configuration, torch-free (services build an EngineConfig without torch).

EngineConfig: how one engine runs (dtype, cache size, batching); the mesh's defaults for these
settings are this class's defaults (services/config.py reads them from here). ModelConfig: a
model's shape and switches (engine/config/families.py maps each family's config.json onto it): one
frozen dataclass for every family, whose differences are switches (q/k norm per head or over
the projection, biases, clip_qkv, MLA, sliding windows and sinks, shared experts, routing,
expert activation, which layers are sparse, rope scaling), so the model files have no
per-architecture branches.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

from evenflow import models
from evenflow.engine.config.fields import ALL_COMMANDS, check_settings, setting
from evenflow.engine.spec.config import SpeculativeConfig

DTYPES = ("float32", "bfloat16", "float16")
# The KV cache's storage (vLLM's names): auto = the model's dtype; int8 = int8 values with a
# float32 scale per (block, KV head) (engine/model/kv_quant.py). fp8_e4m3 is named so that a
# vLLM command line reads, and refused: no CPU we run on computes fp8 natively.
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
# engine/quant/stacks.py implements them (this module is torch-free)
QUANT_METHODS = ("int8", "int4", "w8a8")
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
    EngineSwitch("EVENFLOW_NATIVE_BUILD", "wait", "wait: a process needing the native kernels "
                 "builds them (or waits for another's build); background: torch's kernels serve "
                 "until another process's build is done, then the engine switches to them when "
                 "idle (`evenflow up` on a machine's first start)", on_off=False),
    EngineSwitch("EVENFLOW_NATIVE_MARCH", "native", "the GCC -march the kernels are built for "
                 "(e.g. haswell: an AVX2 machine's code paths)", on_off=False),
    EngineSwitch("EVENFLOW_NATIVE_NORM", "1", "fused RMSNorm + residual add"),
    EngineSwitch("EVENFLOW_NATIVE_ROTARY", "1", "the decode step's fused rotary + KV write"),
    EngineSwitch("EVENFLOW_NATIVE_ATTENTION", "1", "paged decode attention"),
    EngineSwitch("EVENFLOW_NATIVE_MLA", "1", "MLA's decode (DeepSeek-V2 / -V3: absorbed "
                 "queries, attention over the paged latents, values up) in one call"),
    EngineSwitch("EVENFLOW_NATIVE_PREFILL_ATTENTION", "1", "causal prefill attention over the "
                 "paged cache"),
    EngineSwitch("EVENFLOW_NATIVE_KV_BLOCKS", "1", "the K/V hand-off's block copies"),
    EngineSwitch("EVENFLOW_NATIVE_KV_INT8", "1", "the int8 KV cache's write and decode "
                 "attention"),
    EngineSwitch("EVENFLOW_NATIVE_MOE", "1", "the fused routed-experts kernel"),
    EngineSwitch("EVENFLOW_NATIVE_LINEAR", "1", "dense linears over panel-packed weights"),
    EngineSwitch("EVENFLOW_NATIVE_ROUTING", "1", "MoE routing (softmax, top-k) in one call"),
    EngineSwitch("EVENFLOW_NATIVE_AMX", "1", "bf16 panel linears and fused experts on AMX tiles "
                 "from 16 rows (prefill, large batches), where the CPU has AMX"),
    EngineSwitch("EVENFLOW_NATIVE_W4A8", "1", "int4 weights (where VNNI is) against rows "
                 "quantized to int8 per group, for a decode step's few rows (as llama.cpp's Q4_0 "
                 "x Q8_0)"),
    EngineSwitch("EVENFLOW_NATIVE_INT8_ROWS", "1", "int8 weights (where VNNI is) in w8a8's "
                 "layout, so that rows may meet them as int8 rows (quantized per token) where "
                 "the kernel plan measures that faster (0: weight-only numerics at every count)"),
    EngineSwitch("EVENFLOW_KERNEL_PLANS", "1", "measure once per machine from how many rows a "
                 "quantized panel is dequantized first (0: the kernels' built-in thresholds)"),
    EngineSwitch("EVENFLOW_FAST_DECODE", "1", "a decode step's layers as one native call"),
    EngineSwitch("EVENFLOW_WINDOW_POOL", "1", "sliding-window layers keep their K/V in a pool "
                 "of their own that holds only the window (0: in the one block table, every "
                 "block kept while the sequence runs)"),
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


def check_kv_cache_dtype(kv_cache_dtype: str, tensor_parallel_size: int = 1) -> None:
    """ValueError naming the problem with this KV cache dtype, if any."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, "
                         f"got {kv_cache_dtype!r}")
    if kv_cache_dtype == "fp8_e4m3":
        raise ValueError("kv_cache_dtype fp8_e4m3 needs native fp8 math, which this CPU lacks; "
                         "use int8 (the same bytes per token)")
    if kv_cache_dtype == "int8" and tensor_parallel_size > 1:
        raise ValueError("kv_cache_dtype int8 with tensor_parallel_size > 1 is not supported "
                         "yet")


_ENGINE_FLAGS = ALL_COMMANDS  # the engine's flags: on `up`, `serve` and `generate`


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs. Each field is a setting (engine/config/fields.py): its range,
    choices, flag and help are declared here once, and the mesh inherits them
    (services/config.py MeshConfig)."""

    model: str = setting(models.DEFAULT_MODEL, flag=True, commands=_ENGINE_FLAGS,
                         help="built-in model name, checkpoint dir, GGUF file or Hugging Face "
                              "id (org/name)")
    dtype: str = setting("auto", choices=("auto", *DTYPES), flag=True, commands=_ENGINE_FLAGS,
                         help="auto: bfloat16 where the CPU has native bf16 math, else float32")
    block_size: int = setting(16, ge=1, help="tokens per KV block")
    num_kv_blocks: int | None = setting(None, ge=1, flag=True,
                                        help="KV blocks per worker (unset: as many as "
                                             "kv_cache_gb holds)")
    kv_cache_gb: float = setting(0.5, gt=0, flag=True, help="KV cache per worker, in GiB")
    kv_cache_dtype: str = setting(
        "auto", choices=KV_CACHE_DTYPES, flag=True, commands=_ENGINE_FLAGS,
        help="the KV cache's storage: auto (the model's dtype) or int8 (per-block scales: twice "
             "the blocks in the same memory, half the hand-off's bytes); fp8_e4m3 needs a CPU "
             "with native fp8")
    # The KV cache's disk tier (engine/runners/disk_tier.py): blocks evicted from RAM kept in
    # this directory, up to kv_disk_gb, promoted back on a prefix hit
    kv_disk_dir: str = setting("", flag=True,
                               help="where the KV disk tier lives, kept across restarts (under "
                                    "a mesh: DIR/WORKER_ID); unset with kv_disk_gb > 0: a "
                                    "temporary directory, removed on exit")
    kv_disk_gb: float = setting(0.0, ge=0, flag=True,
                                help="a KV disk tier of this many GiB: blocks evicted from RAM "
                                     "go there and come back on a prefix hit (0: none)")
    max_num_seqs: int = setting(64, ge=1, flag=True, help="sequences per batch")
    max_loras: int = setting(4, ge=1, flag=True,
                             help="LoRA adapters in one batch at most (a request of another "
                                  "waits until one of them has no running request)")
    max_num_batched_tokens: int = setting(2048, ge=1, help="tokens per step (chunked prefill)")
    max_model_len: int | None = setting(None, ge=1, flag=True,
                                        help="context length (unset: the model's, at most 8192)")
    num_threads: int | None = setting(None, ge=1, flag="--threads", commands=_ENGINE_FLAGS,
                                      help="torch threads of each engine (per rank with "
                                           "tensor parallelism; unset: torch's choice)")
    enable_prefix_caching: bool = setting(True, help="reuse cached KV blocks of a shared prefix")
    defer_shared_prefill: bool = setting(
        True, help="a request whose next block another request is computing waits a step and "
                   "hits the cache (a burst sharing a new prefix computes it once); off only to "
                   "measure what it saves")
    num_ep_ranks: int = setting(
        0, ge=0, help="expert placement over this many (virtual) EP ranks: slots = experts + "
                      "redundant slots for replicas of hot experts (0: no placement, no "
                      "balancer)")
    num_redundant_experts: int = setting(0, ge=0, help="extra expert slots for replicas of hot "
                                                       "experts")
    # engine/quant/stacks.py: a GPTQ, AWQ or compressed-tensors checkpoint is loaded quantized
    # as it is, whatever this says
    quantization: str | None = setting(
        None, choices=QUANT_METHODS, flag=True, commands=_ENGINE_FLAGS,
        help="quantization at load: int8 (weight-only, per output channel), int4 (weight-only, "
             "groups, with zero points) or w8a8 (int8 weights and per-token int8 activations, "
             "on VNNI); a GPTQ or compressed-tensors checkpoint needs none")
    quant_group_size: int = setting(64, flag=True, commands=_ENGINE_FLAGS,
                                    help="int4 group size (32, 64 or 128)")
    quant_symmetric: bool = setting(False, help="int4 without zero points")
    quantize_lm_head: bool = setting(False, help="quantize the output head too")
    quant_attention: str = setting(
        "auto", choices=("auto", "same", "int8", "w8a8", "none"), flag=True,
        commands=_ENGINE_FLAGS,
        help="the attention projections' quantization: auto (int8, w8a8: none, left in the "
             "engine's dtype; int4: int8), same as the rest, int8, w8a8 or none. Attention's "
             "value and output projections write the residual stream: they carry most of the "
             "quality a quantized model loses (docs/models.md)")
    quant_skip: str = setting(
        "", help="a regular expression: weights whose module name it finds stay unquantized "
                 "(vLLM's modules_to_not_convert), e.g. 'self_attn' or 'layers\\.0\\.'; "
                 "names as `model.layers.3.self_attn.o_proj`, `model.layers.3.mlp.experts`")
    tensor_parallel_size: int = setting(
        1, ge=1, flag="--tp", commands=_ENGINE_FLAGS,
        help="tensor parallelism: each engine is this many rank processes on this host, each "
             "holding 1/N of every layer's heads and MLP / expert columns")
    expert_parallel_size: int = setting(
        1, ge=1, flag="--ep",
        help="DEP: each worker is a group of this many rank processes, each a worker of its "
             "own with its own requests and KV cache, with expert-parallel MoE layers")
    ep_rendezvous: str = setting(
        "", flag=True, commands=("serve",),
        help="HOST:PORT of the DEP groups' rendezvous store: groups then span hosts and are "
             "elastic (they re-form without a lost rank and take it back)")
    ep_settle_s: float = setting(3.0, ge=0, help="a DEP group forms from the ranks that arrive "
                                                 "within this long (all of them, when they do)")
    show_progress: bool = setting(False, hidden=True,
                                  help="a loading bar on stderr (the offline API: on a terminal)")
    prepack_weights: bool = setting(
        True, help="reorder float weights once into oneDNN's blocked layout "
                   "(engine/weights/prepack.py): decode's skinny matmuls read them up to 2x "
                   "faster; off keeps plain nn.Linear (for comparisons)")
    # Every position's K/V and logits come from the same kernels in the same reduction order,
    # whether it was prefilled, chunk-prefilled, decoded or re-prefilled after a migration, and
    # whatever else is in the batch (prompt tokens run as decoded tokens do:
    # engine/runners/model_runner.py one_token_rows)
    deterministic: bool = setting(
        False, flag=True, commands=_ENGINE_FLAGS,
        help="batch-invariant engines: a position's K/V and logits do not depend on how it was "
             "scheduled, so a migrated stream continues text-identically (prefill costs more; "
             "not with quantization, tensor or expert parallelism)")
    # engine/spec/: draft tokens proposed and verified in one step (the JSON text; LLM also
    # takes a dict)
    speculative_config: str | None = setting(
        None, flag=True, commands=_ENGINE_FLAGS,
        help='speculative decoding as vLLM configures it, JSON: {"method": "ngram", '
             '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}; '
             'methods ngram, suffix, draft_model ("model": path) and mtp (greedy output '
             "unchanged; sampling keeps its distribution)")

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):
            object.__setattr__(self, "speculative_config",
                               SpeculativeConfig.parse(self.speculative_config).text())  # type: ignore[union-attr]
        check_settings(self)
        self.check_combinations()

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    def check_combinations(self) -> None:
        """The checks that involve several settings (each one's own range is declared)."""
        check_kv_cache_dtype(self.kv_cache_dtype, self.tensor_parallel_size)
        SpeculativeConfig.parse(self.speculative_config)
        if self.kv_disk_dir and self.kv_disk_gb <= 0:
            raise ValueError("kv_disk_dir needs kv_disk_gb > 0 (the disk tier's size)")
        if self.quantization is not None:
            check_quantization(self.quantization, self.quant_group_size)
        if self.tensor_parallel_size > 1 and self.expert_parallel_size > 1:
            raise ValueError("tensor and expert parallelism together are not supported yet")
        if self.deterministic and (self.quantization or self.tensor_parallel_size > 1
                                   or self.expert_parallel_size > 1):
            raise ValueError("deterministic mode does not serve quantization (its kernels are "
                             "chosen by row count), tensor parallelism (its all-reduce order) "
                             "or expert parallelism across ranks (not checked)")


def check_quantization(method: str, group_size: int) -> None:
    """ValueError unless engine/quant/stacks.py implements `method` with this (int4) group size."""
    if method not in QUANT_METHODS:
        raise ValueError(f"quantization must be one of {list(QUANT_METHODS)}, got {method!r}")
    if method == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size (quant_group_size) must be one of "
                         f"{list(INT4_GROUP_SIZES)}, got {group_size}")


class ModelLoadError(ValueError):
    """The checkpoint cannot be served: unknown architecture, missing or corrupt files."""


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
    """One model's shape and switches (engine/config/families.py maps each family's config.json onto
    it). Attention is grouped-query attention, or multi-head latent attention (MLA, DeepSeek
    V2/V3) where kv_lora_rank > 0; feed-forward layers are dense MLPs or routed experts."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # query/key head width (MLA: nope + rope dims)
    intermediate_size: int  # dense MLP width
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool = False
    # The decoder layer's norms (model/norm.py, model/transformer.py): RMSNorm, or LayerNorm
    # without a bias (DBRX); before each sublayer ("pre"), or on each sublayer's output before
    # its residual add, with no input norm ("post": OLMo 2's, FlexOlmo)
    norm_kind: str = "rms"
    norm_placement: str = "pre"
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False
    qk_norm: bool = False  # RMSNorm on q and k: per head (Qwen3), or over the whole projection
    qk_norm_whole: bool = False  # (OLMoE)
    qk_norm_after_rope: bool = False  # per head, on q and k as rotary leaves them (HunYuan)
    clip_qkv: float | None = None  # q, k and v clamped to [-clip, clip] (OLMoE)
    rope: RopeScaling = field(default_factory=RopeScaling)
    partial_rotary: float = 1.0  # share of each head's dims rotary turns (the first ones)
    attention_scale: float = 0.0  # softmax scale; 0: head_dim ** -0.5
    # Sliding-window attention per layer (0: full attention), empty: every layer full; and a
    # learned per-head sink logit in every softmax (GPT-OSS)
    layer_windows: tuple[int, ...] = ()
    attention_sinks: bool = False
    # Multi-head latent attention (DeepSeek V2/V3): the cache holds kv_lora_rank + qk_rope dims
    # per token and layer; q through a low-rank pair when q_lora_rank > 0
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Rotary dims in interleaved pairs: DeepSeek's (model/mla.py reorders them), Ernie 4.5's
    # (grouped-query attention: reordered in the q and k rows at load, engine/weights/loader.py)
    rope_interleave: bool = False
    # MoE; num_experts == 0 means dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = True  # Qwen2-MoE's sigmoid gate; DeepSeek's shared experts: none
    sparse_layers: tuple[bool, ...] = field(default=())  # per layer: MoE (True) or dense MLP
    # next-token (MTP) layers stored after the decoder's (DeepSeek-V3, GLM-4.5): speculative
    # decoding's `mtp` drafts with the first (engine/model/next_token.py)
    num_nextn_predict_layers: int = 0
    # Routing (model/routing.py): softmax over every expert, sigmoid scores (DeepSeek-V3), or a
    # softmax over the top-k logits (GPT-OSS); group-limited choice (n groups, the best
    # topk_groups by their max or top-2 sum); a per-expert bias added for the choice only
    # (DeepSeek-V3's e_score_correction_bias); the chosen weights times a scaling factor
    router_scoring: str = "softmax"
    router_bias: bool = False
    score_correction_bias: bool = False
    num_expert_groups: int = 1
    topk_groups: int = 1
    group_scoring: str = "max"
    routed_scaling_factor: float = 1.0
    # Routed experts' biases and activation: silu(gate) * up, or GPT-OSS's clamped SwiGLU
    expert_bias: bool = False
    expert_activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Granite-MoE's multipliers, folded into the weights at load (engine/weights/loader.py):
    # the embedding's output times embedding_multiplier, each residual branch (attention, MLP or
    # MoE) times residual_multiplier, the logits divided by logits_scaling
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @property
    def folds_head(self) -> bool:
        """The embedding or lm_head carries a multiplier (so a tied pair is untied at load)."""
        return self.embedding_multiplier != 1.0 or self.logits_scaling != 1.0

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "heads must be a multiple of KV heads"
        assert len(self.sparse_layers) == self.num_layers
        assert not self.layer_windows or len(self.layer_windows) == self.num_layers
        if self.num_experts:
            assert 0 < self.num_experts_per_tok <= self.num_experts
            assert self.num_experts % self.num_expert_groups == 0
        assert self.router_scoring in ("softmax", "sigmoid", "softmax_topk")
        assert self.group_scoring in ("max", "top2_sum")
        assert self.expert_activation in ("silu", "clamped_swiglu")
        assert self.norm_kind in ("rms", "layer")
        assert self.norm_placement in ("pre", "post")

    @property
    def is_moe(self) -> bool:
        return any(self.sparse_layers)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.sparse_layers)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rotary_dim(self) -> int:
        """Dims rotary embeddings turn, per head (MLA: the rope part only)."""
        return self.qk_rope_head_dim if self.mla else int(self.head_dim * self.partial_rotary)

    @property
    def scale(self) -> float:
        return self.attention_scale or self.head_dim**-0.5

    def window(self, layer: int) -> int:
        """Layer's sliding window in tokens (0: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def kv_parts(self, kv_heads: int | None = None) -> tuple[tuple[int, int], ...]:
        """Each layer's cache tensors as (heads, dims) per token: K and V of `kv_heads` heads
        (default: all), or MLA's one latent of kv_lora_rank + rope dims (shared by every head,
        so never split)."""
        if self.mla:
            return ((1, self.kv_lora_rank + self.qk_rope_head_dim),)
        heads = self.num_kv_heads if kv_heads is None else kv_heads
        return ((heads, self.head_dim), (heads, self.head_dim))

    @property
    def kv_elements_per_token(self) -> int:
        """Cache elements one token takes over all layers (x dtype size = bytes)."""
        return self.num_layers * sum(h * d for h, d in self.kv_parts())
