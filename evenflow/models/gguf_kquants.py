"""Writing llama.cpp's K-quants (Q4_K, Q5_K, Q6_K) from float weights, in the block layouts
gguf_blocks.py reads (llama.cpp's ggml-common.h), and the mixes llama-quantize names Q4_K_M and
Q5_K_M. Torch-free (numpy): `evenflow gguf export --type q4_k_m` and the benchmarks use it.

The encoders are plain round-to-nearest with min/max scales (llama.cpp searches its scales a
little further, for a slightly smaller error): any file they write is a valid K-quant that
llama.cpp and gguf-py read, and every value is what a reader decodes.
"""

from __future__ import annotations

import numpy as np

from evenflow.models.gguf_blocks import Q4_K, Q5_K, Q6_K, QK_K


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, 0 where b is 0 (b broadcasts against a)."""
    return np.divide(a, b, out=np.zeros_like(a), where=np.broadcast_to(b != 0, a.shape))


def _pack_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 6-bit scales and mins (B, 8) -> Q4_K / Q5_K's 12 bytes (B, 12)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return out


def _asymmetric(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """x (B, 8, 32) -> (d, dmin as float16 bytes (B, 2) each, packed scales (B, 12), q (B, 8, 32)
    in 0..levels) with w = d * sc * q - dmin * m."""
    low = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - low) / levels  # (B, 8)
    minimum = -low
    d, dmin = _f16(scale.max(-1) / 63), _f16(minimum.max(-1) / 63)
    sc = np.clip(np.round(_safe_div(scale, d.astype(np.float32)[:, None])), 0, 63)
    m = np.clip(np.round(_safe_div(minimum, dmin.astype(np.float32)[:, None])), 0, 63)
    step = d.astype(np.float32)[:, None] * sc
    shift = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.round(_safe_div(x + shift[..., None], step[..., None])), 0, levels)
    return d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), \
        _pack_scales(sc, m), q.astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """q (B, 8, 32) 4-bit parts -> (B, 128): per 64, sub-block 2c low, 2c + 1 high."""
    q = q & 0xF
    return (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(q.shape[0], 128)


def encode(kind: int, w: np.ndarray) -> np.ndarray:
    """w (rows, K), K a multiple of 256 -> blocks (rows, K / 256 * block bytes) uint8."""
    rows, k = w.shape
    if k % QK_K:
        raise ValueError(f"K-quants need rows of a multiple of {QK_K} weights, not {k}")
    x = w.astype(np.float32).reshape(-1, QK_K)
    if kind == Q4_K:
        d, dmin, scales, q = _asymmetric(x.reshape(-1, 8, 32), 15)
        blocks = np.concatenate([d, dmin, scales, _nibbles(q)], axis=1)
    elif kind == Q5_K:
        d, dmin, scales, q = _asymmetric(x.reshape(-1, 8, 32), 31)
        bit = (q >> 4) & 1  # (B, 8, 32): bit s of qh[l] is sub-block s's fifth bit
        qh = (bit << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8)
        blocks = np.concatenate([d, dmin, scales, qh, _nibbles(q)], axis=1)
    elif kind == Q6_K:
        sub = x.reshape(-1, 16, 16)
        scale = np.abs(sub).max(-1) / 31  # (B, 16)
        d = _f16(scale.max(-1) / 127)
        sc = np.clip(np.round(_safe_div(scale, d.astype(np.float32)[:, None])), -128, 127)
        step = (d.astype(np.float32)[:, None] * sc)[..., None]
        q = (np.clip(np.round(_safe_div(sub, step)), -32, 31) + 32).astype(np.uint8)
        q = q.reshape(-1, 2, 128)  # halves of 128, value order
        ql = (q[..., 0:64] & 0xF) | ((q[..., 64:128] & 0xF) << 4)  # (B, 2, 64)
        qh = (q[..., 0:32] >> 4) | ((q[..., 32:64] >> 4) << 2) | \
            ((q[..., 64:96] >> 4) << 4) | ((q[..., 96:128] >> 4) << 6)  # (B, 2, 32)
        blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64),
                                 sc.astype(np.int8).view(np.uint8),
                                 d.view(np.uint8).reshape(-1, 2)], axis=1)
    else:
        raise ValueError(f"no K-quant encoder for GGUF type {kind}")
    return np.ascontiguousarray(blocks).reshape(rows, -1)


def more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's use_more_bits: the layers whose attn_v and ffn_down a _M mix keeps in
    Q6_K (the first and last eighth, and every third between)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or \
        (layer - layers // 8) % 3 == 2


def mix_type(mix: str, gguf_name: str, layers: int) -> str:
    """The type a `q4_k_m` / `q5_k_m` mix gives a tensor: output.weight and the more_bits
    layers' attn_v / ffn_down Q6_K, the rest the mix's base type."""
    base = mix.removesuffix("_m")
    if gguf_name == "output.weight":
        return "q6_k"
    parts = gguf_name.split(".")
    if parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down", "ffn_down_exps") and \
            more_bits(int(parts[1]), layers):
        return "q6_k"
    return base
