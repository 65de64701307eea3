"""RMSNorm, with the residual add fused into it where the native kernel serves (kernels/norm.cpp,
chosen by the runner when it attaches the model: ModelRunner.choose_kernels); LayerNorm without
a bias (DBRX), in torch, with the same two calls."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels: Any = None  # kernels/norm.cpp, as the runner chose (None: torch's)

    def forward(self, x: Tensor) -> Tensor:
        kernels = self.kernels
        if kernels is not None and x.dtype == self.weight.dtype and x.is_contiguous():
            return kernels.rms_norm(x, self.weight, self.eps)  # one pass (kernels/norm.cpp)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_and_norm(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(x + residual, its norm), in one pass when the runner chose the native kernel."""
        kernels = self.kernels
        if kernels is not None and x.dtype == residual.dtype == self.weight.dtype and \
                x.is_contiguous() and residual.is_contiguous():
            return kernels.add_rms_norm(x, residual, self.weight, self.eps)
        x = x + residual
        return x, F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm without a bias (DBRX's): RMSNorm's interface, torch's layer_norm."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, None, self.eps)

    def add_and_norm(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        x = x + residual
        return x, self.forward(x)


def layer_norm(kind: str, dim: int, eps: float) -> RMSNorm | LayerNorm:
    """A decoder layer's or the final norm of ModelConfig.norm_kind ("rms" or "layer")."""
    return LayerNorm(dim, eps) if kind == "layer" else RMSNorm(dim, eps)
