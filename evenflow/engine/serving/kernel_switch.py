"""Which kernels an engine runs, and its switch onto the native ones (a part Engine holds,
`engine.kernels`). On a machine's first start the native kernels build in another process
while the engine serves on torch's (EVENFLOW_NATIVE_BUILD=background); the engine thread calls
`switch_when_ready` while idle, and once the build is done the weights are reloaded so that
every layer takes the native kernels' forms (panel-packed, fused experts), over the same KV
cache (its blocks, prefix cache and disk tier stay valid)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from evenflow.engine.config.settings import EngineConfig
from evenflow.engine.kernels import native, plan
from evenflow.engine.model.transformer import CausalLM
from evenflow.engine.weights.form import short_dtype
from evenflow.engine.weights.loader import load_weights, torch_dtype
from evenflow.proto.engine_values import ServingForm


class KernelOwner(Protocol):
    """What the part reads and replaces of its engine."""

    config: EngineConfig
    model_dir: Path
    model: CausalLM
    runner: Any  # the model runner (attach: the reloaded model)
    placement: Any  # its slot_counts, which the reloaded MoE layers count into
    weight_form: str
    dtype: torch.dtype  # the model's compute dtype

    @property
    def kv_dtype(self) -> torch.dtype: ...
    @property
    def tensor_parallel(self) -> bool: ...
    def has_unfinished(self) -> bool: ...


class KernelSwitch:
    def __init__(self, owner: KernelOwner) -> None:
        self._owner = owner  # its model and runner are replaced by a switch

    def summary(self) -> str:
        """What runs, for the worker's ready line: weights, KV cache, kernels."""
        form = self.serving_form()
        return f"weights {form.weights}; KV cache {form.kv_cache}; {form.kernels}"

    @property
    def pending(self) -> bool:
        """Serving on torch's kernels while the native ones build elsewhere."""
        return native.pending()

    def serving_form(self) -> ServingForm:
        """(weight form, KV cache dtype, kernels): what /v1/models reports per worker."""
        engine = self._owner
        # (what the runner decided when it built the model's forward, not the environment now)
        fast = "" if engine.model.decode_stack_builder is not None else "; fast decode off " \
            "(EVENFLOW_FAST_DECODE=0)"
        deterministic = getattr(engine.runner, "deterministic", False)
        numerics = f"deterministic {short_dtype(engine.dtype)}" if deterministic else ""
        return ServingForm(engine.weight_form, short_dtype(engine.kv_dtype),
                           native.summary() + fast, numerics)

    def switch_when_ready(self) -> str | None:
        """Reload onto the native kernels once their build is done (called while idle).
        Returns the new kernel summary when it switched, else None. A tensor-parallel or
        expert-parallel engine never defers (its ranks would have to switch together):
        `evenflow up` builds first for those."""
        engine = self._owner
        if not native.pending() or engine.has_unfinished() or not native.is_built() or \
                engine.tensor_parallel:
            return None
        old_layers = engine.model.moe_layers()
        if any(layer.ep is not None for layer in old_layers):
            return None
        native.refresh()
        plan.forget_choices()  # (measured without the native kernels)
        if native.ops() is None:  # the build would not load here: torch's kernels stay
            return None
        placements = [layer.placement for layer in old_layers]  # (EPLB's virtual ranks)
        del old_layers
        dtype = torch_dtype(engine.config)
        engine.model = engine.runner.model = None  # type: ignore[assignment]  # (freed first)
        engine.model = load_weights(engine.model_dir, dtype, engine.config, None)
        engine.runner.attach(engine.model)
        slot_counts = engine.placement.slot_counts
        for row, (layer, placement) in enumerate(zip(engine.model.moe_layers(), placements,
                                                     strict=True)):
            if slot_counts.numel():
                layer.slot_counts = slot_counts[row]
            if placement is not None:
                layer.set_placement(placement)
        return self.summary()
