"""Rotary position embeddings: the cos / sin tables attention multiplies q and k by, with the
frequency scalings checkpoints use (engine/config/settings.py RopeScaling: linear, llama3,
yarn), computed as transformers computes them."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from evenflow.engine.config.settings import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> Tensor:
    """(head_dim / 2,) float32 inverse frequencies."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    kind = scaling.rope_type
    if kind == "linear":
        return inv_freq / scaling.factor
    if kind == "llama3":
        old = scaling.original_max_position_embeddings
        low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    assert kind == "default", kind
    return inv_freq


def _yarn(dim: int, base: float, s: RopeScaling) -> Tensor:
    """NTK-by-parts: extrapolated high frequencies, interpolated low ones, a linear ramp
    between the correction dims (transformers' _compute_yarn_parameters)."""
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))) \
            / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (no singularity)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    keep = 1 - ramp  # the share of extrapolation
    return interpolation * (1 - keep) + extrapolation * keep


def rope_tables(head_dim: int, theta: float, max_len: int, dtype: torch.dtype,
                scaling: RopeScaling | None = None) -> tuple[Tensor, Tensor]:
    """(cos, sin), each (max_len, head_dim); sin's first half negated for the roll in
    Attention.forward (rotate-half as one multiply-add)."""
    scaling = scaling or RopeScaling()
    inv_freq = inverse_frequencies(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # (max_len, head_dim)
    cos, sin = emb.cos(), emb.sin()
    if scaling.attention_factor != 1.0:
        cos, sin = cos * scaling.attention_factor, sin * scaling.attention_factor
    sin[:, : head_dim // 2].neg_()
    return cos.to(dtype), sin.to(dtype)
