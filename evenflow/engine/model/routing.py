"""MoE routing: the router's logits -> each token's top-k experts and their weights, and the
per-expert pair counts EPLB gathers.

The common case (softmax over every expert, top-k, renormalized when the model says so) is one
native call (kernels/routing.cpp) where the kernels are built, else torch's softmax / topk /
bincount. The other families' routing (`Routing`, read from ModelConfig) runs in torch, in
float32, as transformers computes it:

- sigmoid scores with a per-expert correction bias added for the choice only (DeepSeek-V3),
- group-limited choice: experts in n groups, only the best topk_groups groups (ranked by their
  best score, or the sum of their best two) compete (DeepSeek-V2 / -V3),
- a softmax over the k largest logits only (GPT-OSS),
- the chosen weights times routed_scaling_factor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from evenflow.engine.config.settings import ModelConfig
from evenflow.engine.kernels.panels import PanelLinear


@dataclass(frozen=True)
class Routing:
    num_experts: int
    top_k: int
    renormalize: bool
    scoring: str = "softmax"  # softmax | sigmoid | softmax_topk
    num_groups: int = 1
    topk_groups: int = 1
    group_scoring: str = "max"  # max | top2_sum
    scaling: float = 1.0

    @classmethod
    def of(cls, cfg: ModelConfig) -> Routing:
        return cls(cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                   cfg.router_scoring, cfg.num_expert_groups, cfg.topk_groups,
                   cfg.group_scoring, cfg.routed_scaling_factor)

    @property
    def plain(self) -> bool:
        """Softmax over every expert, top-k, no groups, no scaling: the native kernel's."""
        return self.scoring == "softmax" and self.num_groups == 1 and self.scaling == 1.0


def route(gate: nn.Module, x: Tensor, routing: Routing, counts: Tensor | None,
          score_bias: Tensor | None = None, kernel: Any = None) -> tuple[Tensor, Tensor]:
    """(weights (T, k) float32, experts (T, k) int64) for x (T, H); `counts` (E,) int64, if
    given, gets each expert's pairs added; `score_bias` (E,): DeepSeek-V3's correction bias;
    `kernel`: native.route_topk() as the runner chose it (plain routing only)."""
    E, k = routing.num_experts, routing.top_k
    kernel = kernel if routing.plain and score_bias is None else None
    if kernel is not None:
        # The panel router's whole padded panel goes in: the kernel reads the first E columns.
        logits = gate.padded(x) if isinstance(gate, PanelLinear) else gate(x)
        return kernel(logits, E, k, routing.renormalize, counts)
    logits = _float_logits(gate, x)
    if routing.scoring == "softmax_topk":
        top, experts = torch.topk(logits, k, dim=-1)
        weights = F.softmax(top, dim=-1)
    else:
        scores = torch.sigmoid(logits) if routing.scoring == "sigmoid" else \
            F.softmax(logits, dim=-1)
        choice = scores if score_bias is None else scores + score_bias.float()
        if routing.num_groups > 1:
            choice = _limit_to_groups(choice, routing)
        experts = torch.topk(choice, k, dim=-1)[1]
        weights = scores.gather(1, experts)
        if routing.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routing.scaling != 1.0:
        weights = weights * routing.scaling
    if counts is not None:
        counts += torch.bincount(experts.flatten(), minlength=E)
    return weights, experts


def _float_logits(gate: nn.Module, x: Tensor) -> Tensor:
    """The router's logits in float32 (a plain nn.Linear computes them in float32 too, as
    transformers' DeepSeek router does; a packed one in the model's dtype)."""
    if type(gate) is nn.Linear:
        return F.linear(x.float(), gate.weight.float(),
                        None if gate.bias is None else gate.bias.float())
    return gate(x).float()


def _limit_to_groups(choice: Tensor, routing: Routing) -> Tensor:
    """Scores outside each token's best topk_groups groups set to -inf (they cannot win)."""
    T, n = choice.shape[0], routing.num_groups
    grouped = choice.view(T, n, -1)
    if routing.group_scoring == "top2_sum":
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    best = torch.topk(group_scores, routing.topk_groups, dim=-1)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, -1)
