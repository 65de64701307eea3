"""How Hugging Face checkpoints name per-expert tensors (Mixtral's and Qwen's names), for the
loader and the GPTQ reader/writer alike."""

from __future__ import annotations

import re

# model.layers.{layer}.(block_sparse_moe|mlp).experts.{expert}.{projection}[.weight]
# (GPTQ layers are named without `.weight`: their tensors are `.qweight`, `.scales`, ...)
EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                    r"(w1|w2|w3|gate_proj|up_proj|down_proj)(?:\.weight)?$")
# Which part of the expert's MLP each projection is.
ROLE = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down",
        "down_proj": "down"}
