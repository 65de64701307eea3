"""Where an expert-parallel rank gets expert weights it does not hold: read again from the
checkpoint's safetensors files (memory-mapped), in the form the rank keeps them (packed for
oneDNN, quantized, or plain), one expert at a time.

Choice: a placement change re-reads the experts a rank newly needs from the checkpoint instead
of sending them point-to-point from the rank that holds them. Every host of a deployment has
the checkpoint anyway; a read needs no partner rank to be free at the same moment, works the
same across hosts, and costs a page-cache read plus the repack or quantization of one expert
(measured by `evenflow bench ep`: the largest per-layer pause). The weights it yields are
bit-identical to the ones loaded at start, so a placement change never changes the output.

Checkpoints whose experts are not stored one tensor per expert (stacked exports, GPTQ) cannot
be read this way: their ranks keep every expert, as before.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from evenflow.engine.config.settings import ModelConfig
from evenflow.engine.model.transformer import CausalLM
from evenflow.engine.quant.forms import build_stack
from evenflow.engine.quant.stacks import QuantConfig, quantize
from evenflow.engine.weights.hf_names import EXPERT, ROLE
from evenflow.engine.weights.loader import checkpoint_files, tensor_names
from evenflow.engine.weights.prepack import pack

# One expert's (gate_up, down) weights as a MoE layer stores them (engine/model/moe.py).
ExpertWeights = tuple[Any, Any]


class ExpertReader:
    """Reads one (layer, expert)'s weights from the checkpoint files (kept open: mmap)."""

    def __init__(self, where: dict[tuple[int, int, str], tuple[Path, str]],
                 dtype: torch.dtype) -> None:
        self._where, self._dtype = where, dtype
        self._files: dict[Path, Any] = {}

    @classmethod
    def for_checkpoint(cls, files: dict[Path, list[str]], cfg: ModelConfig,
                       dtype: torch.dtype) -> ExpertReader | None:
        """A reader, or None when some expert of some MoE layer is not stored per expert."""
        where: dict[tuple[int, int, str], tuple[Path, str]] = {}
        for path, names in files.items():
            for name in names:
                if name.endswith(".weight") and (m := EXPERT.match(name)):
                    where[(int(m[1]), int(m[2]), ROLE[m[3]])] = (path, name)
        needed = [(layer, e, role) for layer, sparse in enumerate(cfg.sparse_layers) if sparse
                  for e in range(cfg.num_experts) for role in ("gate", "up", "down")]
        if any(key not in where for key in needed):
            return None
        return cls(where, dtype)

    def _tensor(self, layer: int, expert: int, role: str) -> Tensor:
        path, name = self._where[(layer, expert, role)]
        if path not in self._files:
            self._files[path] = safe_open(str(path), framework="pt")
        # a copy: the mapping's pages are not kept resident
        return self._files[path].get_tensor(name).clone()

    def read(self, layer: int, expert: int, form: str,
             quantization: QuantConfig | None) -> ExpertWeights:
        """Expert `expert` of decoder layer `layer` as the loader would have stored it:
        form "packed" (oneDNN), "quantized" (a one-expert QuantStack) or "plain"."""
        gate, up = self._tensor(layer, expert, "gate"), self._tensor(layer, expert, "up")
        down = self._tensor(layer, expert, "down")
        if form == "quantized":
            assert quantization is not None
            # as the loader does: quantized from the checkpoint's own precision
            return (build_stack([quantize(torch.cat([gate, up]), quantization)], self._dtype,
                                gate_up=True),
                    build_stack([quantize(down, quantization)], self._dtype))
        w13, w2 = torch.cat([gate, up]).to(self._dtype), down.to(self._dtype)
        if form == "packed":
            return pack(w13), pack(w2)
        return w13, w2


def read_missing_experts(model: CausalLM, model_dir: Path, dtype: torch.dtype,
                         quantization: QuantConfig | None) -> bool:
    """Make each MoE layer of an expert-parallel rank keep only its own slots' experts, reading
    the ones a placement brings from the checkpoint. False (every expert stays) when the
    checkpoint does not store them one tensor per expert."""
    cfg = model.config
    reader = ExpertReader.for_checkpoint(tensor_names(checkpoint_files(model_dir)), cfg, dtype)
    if reader is None:
        return False
    sparse = [i for i, is_moe in enumerate(cfg.sparse_layers) if is_moe]
    for layer_index, moe in zip(sparse, model.moe_layers(), strict=True):
        moe.fetch_expert = functools.partial(reader.read, layer_index, form=moe.form,
                                             quantization=quantization)
    return True


@dataclass
class StagedPlacement:
    """A new placement being taken one MoE layer at a time."""

    phy2log: Tensor  # (moe_layers, slots)
    share: Tensor | None
    version: int
    next_row: int = 0


@dataclass
class PlacementMoves:
    """What placement changes cost this rank: layers switched, experts read, and the longest
    pause one layer's switch put between two steps."""

    layers: int = 0
    experts_read: int = 0
    max_pause_s: float = 0.0
    total_s: float = 0.0

    def add(self, seconds: float, experts_read: int) -> None:
        self.layers += 1
        self.experts_read += experts_read
        self.max_pause_s = max(self.max_pause_s, seconds)
        self.total_s += seconds
