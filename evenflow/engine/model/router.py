"""MoE routing: the router's logits -> each token's top-k experts and their weights, and the
per-expert pair counts EPLB gathers. One native call (kernels/routing.cpp) where the kernels
are built, else torch's softmax / topk / bincount; both compute softmax of the float32 logits,
the k largest, renormalized to sum 1 when the model says so."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from evenflow.engine.kernels import native
from evenflow.engine.kernels.panels import PanelLinear


def route(gate: nn.Module, x: Tensor, num_experts: int, top_k: int, renormalize: bool,
          counts: Tensor | None) -> tuple[Tensor, Tensor]:
    """(weights (T, k) float32, experts (T, k) int64) for x (T, H); `counts` (E,) int64, if
    given, gets each expert's pairs added."""
    kernel = native.route_topk()
    if kernel is not None:
        # The panel router's whole padded panel goes in: the kernel reads the first E columns.
        logits = gate.padded(x) if isinstance(gate, PanelLinear) else gate(x)
        return kernel(logits, num_experts, top_k, renormalize, counts)
    probs = F.softmax(gate(x).float(), dim=-1)  # (T, E)
    weights, experts = torch.topk(probs, top_k, dim=-1)  # (T, k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if counts is not None:
        counts += torch.bincount(experts.flatten(), minlength=num_experts)
    return weights, experts
