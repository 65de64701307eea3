"""Loading HF-format checkpoints: config.json + model.safetensors (single or sharded with an
index) into a CausalLM, stacking per-expert weights into the model's grouped layout."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from evenflow.engine.config import ModelConfig, ModelLoadError, load_config
from evenflow.engine.model import CausalLM

# Per-expert tensors in HF checkpoints, Mixtral and Qwen naming.
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
    r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
# Already-stacked experts (transformers' in-memory layout, found in some exports).
_STACKED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_ROLE = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down",
         "down_proj": "down"}


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ModelLoadError(f"{index}: not a safetensors index ({exc})") from exc
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights found")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{model_dir}: shard(s) missing: {', '.join(missing)}")
    return files


def _read_tensors(files: list[Path]) -> dict[str, Tensor]:
    tensors: dict[str, Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file ({exc})") from exc
    return tensors


def _to_model_names(cfg: ModelConfig, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename HF tensors to this model's parameters, stacking experts into w13 / w2."""
    state: dict[str, Tensor] = {}
    experts: dict[tuple[int, int, str], Tensor] = {}
    for name, t in tensors.items():
        if m := _EXPERT.match(name):
            experts[(int(m[1]), int(m[2]), _ROLE[m[3]])] = t
        elif m := _STACKED.match(name):
            state[f"model.layers.{m[1]}.mlp.{'w13' if m[2] == 'gate_up_proj' else 'w2'}"] = t
        elif ".block_sparse_moe.gate." in name:
            state[name.replace(".block_sparse_moe.gate.", ".mlp.gate.")] = t
        else:
            state[name] = t
    for layer in range(cfg.num_layers):
        attn = f"model.layers.{layer}.self_attn."
        for kind in ("weight", "bias"):
            parts = [state.pop(f"{attn}{p}_proj.{kind}", None) for p in "qkv"]
            if all(t is not None for t in parts):
                state[f"{attn}qkv_proj.{kind}"] = torch.cat(parts)  # type: ignore[arg-type]
            elif any(t is not None for t in parts):
                raise ModelLoadError(f"checkpoint has only some of {attn}q/k/v_proj.{kind}")
    for layer, sparse in enumerate(cfg.sparse_layers):
        if not sparse or f"model.layers.{layer}.mlp.w13" in state:
            continue
        try:
            gate_up = [torch.cat([experts[(layer, e, "gate")], experts[(layer, e, "up")]])
                       for e in range(cfg.num_experts)]
            down = [experts[(layer, e, "down")] for e in range(cfg.num_experts)]
        except KeyError as exc:
            raise ModelLoadError(f"checkpoint lacks expert weight {exc.args[0]}") from exc
        state[f"model.layers.{layer}.mlp.w13"] = torch.stack(gate_up)
        state[f"model.layers.{layer}.mlp.w2"] = torch.stack(down)
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def load_model(model_dir: str | Path, dtype: torch.dtype) -> CausalLM:
    """Build the model described by config.json and fill it from the safetensors files."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    cfg = load_config(model_dir)
    state = _to_model_names(cfg, _read_tensors(_checkpoint_files(model_dir)))
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = dict(model.state_dict())
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise ModelLoadError(f"checkpoint has unknown tensor(s), e.g. {unexpected[:3]}")
    for name, param in expected.items():
        if tuple(state[name].shape) != tuple(param.shape):
            raise ModelLoadError(
                f"tensor {name} has shape {tuple(state[name].shape)}, config implies "
                f"{tuple(param.shape)}"
            )
        state[name] = state[name].to(dtype)
    model.load_state_dict(state, assign=True, strict=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval().requires_grad_(False)
