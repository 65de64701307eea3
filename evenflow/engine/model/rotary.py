"""Rotary position embeddings: the cos / sin tables attention multiplies q and k by."""

from __future__ import annotations

import torch
from torch import Tensor


def rope_tables(head_dim: int, theta: float, max_len: int, dtype: torch.dtype
                ) -> tuple[Tensor, Tensor]:
    """(cos, sin), each (max_len, head_dim); sin's first half negated for the roll in
    Attention.forward (rotate-half as one multiply-add)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # (max_len, head_dim)
    sin = emb.sin()
    sin[:, : head_dim // 2].neg_()
    return emb.cos().to(dtype), sin.to(dtype)
