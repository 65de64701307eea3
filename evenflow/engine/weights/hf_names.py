"""How Hugging Face checkpoints name (and lay out) MoE tensors, for the loader and the GPTQ
reader/writer alike: per-expert names (Mixtral's, Qwen's, DeepSeek's), the names that differ
from the model's modules, and the families whose stacked experts come transposed."""

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
           (".mlp.router.", ".mlp.gate."),
           # Granite-MoE's stacked experts ([gate | up] and down, as the model holds them) and
           # router
           (".block_sparse_moe.input_linear.weight", ".mlp.w13"),
           (".block_sparse_moe.output_linear.weight", ".mlp.w2"),
           (".block_sparse_moe.router.layer.", ".mlp.gate."))
# Stacked experts stored as (E, H, 2I) with gate and up interleaved column by column, and
# down as (E, I, H), with biases (GPT-OSS); the model holds (E, 2I, H) [gate | up] and (E, H, I).
TRANSPOSED_EXPERTS = ("GptOssForCausalLM",)
