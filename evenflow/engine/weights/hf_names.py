"""How Hugging Face checkpoints name (and lay out) MoE tensors, for the loader and the GPTQ
reader/writer alike: per-expert names (Mixtral's, Qwen's, DeepSeek's), the names that differ
from the model's modules, the families whose stacked experts come transposed, and the families
that name every module their own way (DBRX)."""

from __future__ import annotations

import re

# model.layers.{layer}.(block_sparse_moe|mlp).experts.{expert}.{projection}[.weight]
# (GPTQ layers are named without `.weight`: their tensors are `.qweight`, `.scales`, ...)
EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                    r"(w1|w2|w3|gate_proj|up_proj|down_proj)(?:\.weight)?$")
# Which part of the expert's MLP each projection is.
ROLE = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down",
        "down_proj": "down"}

# Checkpoint module names -> the model's (DeepSeek's shared experts and score-correction bias,
# GPT-OSS's router).
RENAMES = ((".mlp.shared_experts.", ".mlp.shared_expert."),
           (".mlp.gate.e_score_correction_bias", ".mlp.score_bias"),
           (".mlp.moe_statics.e_score_correction_bias", ".mlp.score_bias"),  # (Ernie's: (1, E))
           (".block_sparse_moe.e_score_correction_bias", ".mlp.score_bias"),  # (MiniMax-M2's)
           (".mlp.router.", ".mlp.gate."),
           # Granite-MoE's stacked experts ([gate | up] and down, as the model holds them) and
           # router
           (".block_sparse_moe.input_linear.weight", ".mlp.w13"),
           (".block_sparse_moe.output_linear.weight", ".mlp.w2"),
           (".block_sparse_moe.router.layer.", ".mlp.gate."),
           # Granite-MoE-Shared's shared MLP (its input_linear is split: GATE_UP)
           (".shared_mlp.output_linear.", ".mlp.shared_expert.down_proj."),
           # HunYuan-MoE's router, shared MLP and q/k norms
           (".mlp.gate.wg.", ".mlp.gate."), (".mlp.shared_mlp.", ".mlp.shared_expert."),
           (".self_attn.query_layernorm.", ".self_attn.q_norm."),
           (".self_attn.key_layernorm.", ".self_attn.k_norm."))
# A dense MLP's [gate | up] in one stored tensor -> the model's MLP whose gate_proj and up_proj
# it is split into (Granite-MoE-Shared's shared MLP).
GATE_UP = {".shared_mlp.input_linear.weight": ".mlp.shared_expert."}
# Stacked experts stored as (E, H, 2I) with gate and up interleaved column by column, and
# down as (E, I, H), with biases (GPT-OSS); the model holds (E, 2I, H) [gate | up] and (E, H, I).
TRANSPOSED_EXPERTS = ("GptOssForCausalLM",)

# Families whose checkpoints name every module their own way, by architecture: their names as
# read -> the usual HF ones (model.layers.{i}.…; the model's own where there is none usual, as
# for DBRX's fused q | k | v), before anything else looks at them.
STORED_NAMES = {
    "DbrxForCausalLM": (
        ("transformer.blocks.", "model.layers."), ("transformer.wte.", "model.embed_tokens."),
        ("transformer.norm_f.", "model.norm."),
        (".norm_attn_norm.attn.Wqkv.", ".self_attn.qkv_proj."),  # (q | k | v, as the model's)
        (".norm_attn_norm.attn.out_proj.", ".self_attn.o_proj."),
        (".norm_attn_norm.norm_1.", ".input_layernorm."),
        (".norm_attn_norm.norm_2.", ".post_attention_layernorm."),
        (".ffn.router.layer.", ".mlp.gate."), (".ffn.experts.mlp.", ".mlp.experts.")),
}
# DBRX's experts, each stacked over experts' rows: w1 (gate) and v1 (up) as (E * I, H), w2
# (down) as (E * I, H) too, i.e. each expert's down transposed.
ROW_STACKED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(w1|v1|w2)$")


def usual_name(architecture: str, name: str) -> str:
    """A stored tensor name as the usual HF checkpoints name it (STORED_NAMES)."""
    for old, new in STORED_NAMES.get(architecture, ()):
        name = name.replace(old, new)
    return name
