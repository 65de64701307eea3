"""Writing a quantized copy of an unquantized HF checkpoint (what `evenflow quantize` does, in
either format: engine/weights/gptq.py, compressed_tensors.py): every quantizable linear weight
replaced by the format's tensors, the rest and the side files (tokenizer, generation config)
copied, and config.json given the format's quantization_config."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from evenflow.engine.weights.hf_names import EXPERT

QUANTIZABLE = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|w1|w2|w3"
                         r"|q_a_proj|q_b_proj|kv_a_proj_with_mqa)\.weight$")


def write_quantized_copy(source: str | Path, out: str | Path,
                         fits: Callable[[tuple[int, ...]], bool],
                         convert: Callable[[str, Tensor], dict[str, Tensor]],
                         quantization_config: dict[str, Any]) -> Path:
    """`convert(base, weight)`: the format's tensors for one quantizable weight `<base>.weight`
    that `fits` (a layer's experts are converted all or none: the engine runs them as one
    stack)."""
    source, out = Path(source), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, Tensor] = {}
    for path in sorted(source.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    unfit_layers = {m[1] for name, t in tensors.items()
                    if (m := EXPERT.match(name)) and not fits(tuple(t.shape))}
    for name in list(tensors):
        t = tensors[name]
        m = EXPERT.match(name)
        if QUANTIZABLE.search(name) and t.dim() == 2 and fits(tuple(t.shape)) and not (
                m and m[1] in unfit_layers):
            tensors |= convert(name.removesuffix(".weight"), tensors.pop(name))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and \
                not path.name.endswith(".index.json") and path.name != "config.json":
            shutil.copy(path, out / path.name)
    model_config = json.loads((source / "config.json").read_text())
    model_config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(model_config, indent=1))
    return out
