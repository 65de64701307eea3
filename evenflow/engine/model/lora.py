"""LoRA adapters served beside the base model, several in one batch.

An adapter is a PEFT checkpoint (adapter_config.json + adapter_model.safetensors) whose
low-rank factors are read onto this engine's fused projections (`load_adapter`): q_proj /
k_proj / v_proj as column ranges of qkv_proj, o_proj, a dense MLP's gate / up / down, a MoE
layer's shared expert, and routed experts per expert, as PEFT writes them for transformers'
fused expert parameters (`target_parameters` experts.gate_up_proj / experts.down_proj) or
for per-expert linears (experts.N.w1 / w3 / w2, or gate_proj / up_proj / down_proj).

Nothing is merged into the base weights: each row of a batch gets its own adapter's deltas
(x A^T B^T x scale) on top of the base projection, so sequences of several adapters and of
none share a step (`Adapters.begin_step`). Dense projections take them through forward
hooks; MoE layers run their routed experts through `MoE._experts_with_adapters`.

The base weights may be in any stored form; the factors stay in the engine's dtype. Refused
at load: DoRA, LoRA biases, fan_in_fan_out, rank or alpha patterns, embedding and lm_head
adapters; the engine refuses tensor and expert parallelism."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from evenflow.engine.config.settings import ModelConfig

LINEAR_TARGETS = ("qkv_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                  "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")


class AdapterError(ValueError):
    """An adapter that cannot be served here; the message says why."""


@dataclass
class Delta:
    """One low-rank addition to a projection's output columns `cols`: x @ a.T @ b.T."""

    cols: slice
    a: Tensor  # (r, in)
    b: Tensor  # (out, r), the scale folded in


@dataclass
class Adapter:
    name: str
    path: str
    # (layer, projection) -> deltas; projection one of LINEAR_TARGETS
    linear: dict[tuple[int, str], list[Delta]] = field(default_factory=dict)
    # (layer, "w13" | "w2") -> logical expert -> deltas (w13: gate columns, then up)
    experts: dict[tuple[int, str], dict[int, list[Delta]]] = field(default_factory=dict)

    def nbytes(self) -> int:
        deltas = [d for ds in self.linear.values() for d in ds] + [
            d for per in self.experts.values() for ds in per.values() for d in ds]
        return sum(d.a.numel() * d.a.element_size() + d.b.numel() * d.b.element_size()
                   for d in deltas)


_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")
_PER_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)$")


def load_adapter(name: str, path: str | Path, cfg: ModelConfig, dtype: torch.dtype) -> Adapter:
    """A PEFT LoRA checkpoint's factors, mapped onto this engine's projections."""
    from safetensors.torch import load_file

    root = Path(path)
    try:
        config = json.loads((root / "adapter_config.json").read_text())
        tensors = load_file(str(root / "adapter_model.safetensors"))
    except (OSError, ValueError) as exc:
        raise AdapterError(f"adapter {name!r}: cannot read a PEFT checkpoint at {root}: "
                           f"{exc}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {config.get('peft_type')} is not LoRA")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if config.get(key) == bad:
            raise AdapterError(f"adapter {name!r}: {key} is not supported")
    if config.get("lora_bias") or config.get("bias", "none") != "none":
        raise AdapterError(f"adapter {name!r}: LoRA biases are not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError(f"adapter {name!r}: rank and alpha patterns are not supported")
    r, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    pairs: dict[tuple[int, str], dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(f"adapter {name!r}: {key} is not a layer's LoRA factor "
                               "(embedding and lm_head adapters are not supported)")
        pairs.setdefault((int(m[1]), m[2]), {})[m[3]] = tensor.to(torch.float32)
    adapter = Adapter(name, str(root))
    for (layer, module), factors in sorted(pairs.items()):
        if layer >= cfg.num_layers or set(factors) != {"A", "B"}:
            raise AdapterError(f"adapter {name!r}: layer {layer} {module} does not fit the "
                               "model")
        _place(adapter, cfg, layer, module, factors["A"], factors["B"], scale, dtype)
    return adapter


def _place(adapter: Adapter, cfg: ModelConfig, layer: int, module: str, a: Tensor, b: Tensor,
           scale: float, dtype: torch.dtype) -> None:
    """One factor pair onto the projection (and columns) it adapts."""
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = {"q_proj": slice(0, nh * hd), "k_proj": slice(nh * hd, (nh + nkv) * hd),
           "v_proj": slice((nh + nkv) * hd, (nh + 2 * nkv) * hd)}
    leaf = module.rsplit(".", 1)[-1]

    def linear(target: str, cols: slice) -> None:
        adapter.linear.setdefault((layer, target), []).append(
            Delta(cols, a.to(dtype), (b * scale).to(dtype)))

    def expert(target: str, e: int, cols: slice, a_e: Tensor, b_e: Tensor) -> None:
        adapter.experts.setdefault((layer, target), {}).setdefault(e, []).append(
            Delta(cols, a_e.contiguous().to(dtype), (b_e * scale).contiguous().to(dtype)))

    inter = cfg.moe_intermediate_size
    per_expert = _PER_EXPERT.match(module)
    if module.startswith("self_attn.") and leaf in qkv:
        linear("qkv_proj", qkv[leaf])
    elif module == "self_attn.o_proj":
        linear("o_proj", slice(None))
    elif module in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj") \
            and not cfg.sparse_layers[layer]:
        linear(leaf, slice(None))
    elif module in ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
                    "mlp.shared_expert.down_proj", "mlp.shared_experts.gate_proj",
                    "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj") \
            and cfg.sparse_layers[layer] and cfg.shared_expert_intermediate_size:
        linear(f"shared_expert.{leaf}", slice(None))
    elif per_expert is not None and cfg.sparse_layers[layer]:
        e, which = int(per_expert[1]), per_expert[2]
        target, cols = {"w1": ("w13", slice(0, inter)), "gate_proj": ("w13", slice(0, inter)),
                        "w3": ("w13", slice(inter, 2 * inter)),
                        "up_proj": ("w13", slice(inter, 2 * inter)),
                        "w2": ("w2", slice(None)), "down_proj": ("w2", slice(None))}.get(
            which, ("", slice(None)))
        if not target or e >= cfg.num_experts:
            raise AdapterError(f"adapter {adapter.name!r}: {module} is not an expert "
                               "projection of this model")
        expert(target, e, cols, a, b)
    elif module in ("mlp.experts", "mlp.experts.base_layer") and cfg.sparse_layers[layer]:
        # PEFT's target_parameters on fused (E, out, in) experts: lora_A (r*E, in) is
        # expert-major, lora_B (out, r*E) rank-major (PEFT ParamWrapper.get_delta_weight)
        E, H = cfg.num_experts, cfg.hidden_size
        rank = a.shape[0] // E
        if (a.shape[1], b.shape[0]) == (H, 2 * inter):
            target = "w13"
        elif (a.shape[1], b.shape[0]) == (inter, H):
            target = "w2"
        else:
            raise AdapterError(f"adapter {adapter.name!r}: {module} factors {tuple(a.shape)}, "
                               f"{tuple(b.shape)} fit neither gate_up_proj nor down_proj")
        a_e, b_e = a.view(E, rank, a.shape[1]), b.view(b.shape[0], rank, E)
        for e in range(E):
            expert(target, e, slice(None), a_e[e], b_e[:, :, e])
    else:
        raise AdapterError(f"adapter {adapter.name!r}: layer {layer} {module} is not a "
                           "projection evenflow adapts (attention q/k/v/o, MLP, experts)")


@dataclass
class StepAdapters:
    """This step's rows per adapter (rows: indices into the step's flat batch)."""

    groups: list[tuple[Adapter, Tensor]]


class Adapters:
    """The adapters one model serves: loaded by name, attached to its projections once, and
    told each step which rows are whose."""

    def __init__(self, model: Any, cfg: ModelConfig, dtype: torch.dtype) -> None:
        self.model, self.cfg, self.dtype = model, cfg, dtype
        self.loaded: dict[str, Adapter] = {}
        self.step: StepAdapters | None = None
        self.row_adapter: Tensor | None = None  # (T,) each row's adapter index in step.groups
        self._attached = False

    def get(self, name: str, path: str) -> Adapter:
        """The adapter, loaded on first use (raises AdapterError)."""
        adapter = self.loaded.get(name)
        if adapter is None or (path and adapter.path != str(Path(path))):
            adapter = self.loaded[name] = load_adapter(name, path, self.cfg, self.dtype)
        self._attach()
        return adapter

    def unload(self, name: str) -> bool:
        return self.loaded.pop(name, None) is not None

    def begin_step(self, row_names: list[str]) -> None:
        """The step's rows, each with its adapter's name ("" for the base model)."""
        names = sorted({n for n in row_names if n})
        if not names:
            self.end_step()
            return
        index = {n: i for i, n in enumerate(names)}
        row_adapter = torch.tensor([index.get(n, -1) for n in row_names], dtype=torch.long)
        self.row_adapter = row_adapter
        self.step = StepAdapters([(self.loaded[n], (row_adapter == i).nonzero().flatten())
                                  for n, i in index.items()])

    def end_step(self) -> None:
        self.step, self.row_adapter = None, None

    def _attach(self) -> None:
        if self._attached:
            return
        self._attached = True
        for layer, block in enumerate(self.model.model.layers):
            modules = {"qkv_proj": getattr(block.self_attn, "qkv_proj", None),
                       "o_proj": getattr(block.self_attn, "o_proj", None)}
            mlp = block.mlp
            if hasattr(mlp, "gate_proj"):
                modules |= {n: getattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")}
            else:
                mlp.adapters, mlp.layer_index = self, layer
                shared = getattr(mlp, "shared_expert", None)
                if shared is not None:
                    modules |= {f"shared_expert.{n}": getattr(shared, n)
                                for n in ("gate_proj", "up_proj", "down_proj")}
            for target, module in modules.items():
                if module is not None:
                    module.register_forward_hook(self._hook(layer, target))

    def _hook(self, layer: int, target: str):
        def add_deltas(_module: nn.Module, inputs: tuple[Tensor, ...], out: Tensor) -> Tensor:
            step = self.step
            if step is None:
                return out
            x = inputs[0]
            for adapter, rows in step.groups:
                for delta in adapter.linear.get((layer, target), ()):
                    out[rows, delta.cols] += apply(x[rows], delta).to(out.dtype)
            return out
        return add_deltas


def apply(x: Tensor, delta: Delta) -> Tensor:
    return (x.to(delta.a.dtype) @ delta.a.T) @ delta.b.T
