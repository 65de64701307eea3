"""GGUF's quantized blocks (llama.cpp's ggml-common.h) read as integer codes with a scale and an
offset per group: w = q * scale + offset, exactly the file's values. Torch-free (numpy), as
everything in models/; the engine turns the codes into its stored forms at load
(engine/weights/gguf_weights.py).

Layouts, per row of K weights (K a multiple of the block):
- Q4_0, blocks of 32 (18 bytes): f16 d, 16 bytes; code j in byte j's low nibble, j + 16 in its
  high one; w = d * (q - 8).
- Q4_1, blocks of 32 (20 bytes): f16 d, f16 m, 16 bytes as Q4_0's; w = d * q + m.
- Q5_0, blocks of 32 (22 bytes): f16 d, 4 bytes qh (bit j: code j's fifth bit), 16 bytes as
  Q4_0's; w = d * (q - 16).
- Q5_1, blocks of 32 (24 bytes): f16 d, f16 m, qh, 16 bytes; w = d * q + m.
  (llama-quantize writes these three where a K-quant's rows are not whole super-blocks.)
- Q8_0, blocks of 32 (34 bytes): f16 d, 32 int8; w = d * q.
- Q4_K, super-blocks of 256 (144 bytes): f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) pairs
  for 8 sub-blocks of 32, 128 bytes of nibbles (per 64: sub-block 2i in the low nibbles of 32
  bytes, 2i + 1 in their high ones); w = d * sc * q - dmin * m.
- Q5_K, super-blocks of 256 (176 bytes): as Q4_K with 32 bytes `qh` after the scales: the fifth
  bit of value l of sub-block s is bit s of qh[l]; w = d * sc * q - dmin * m, q in 0..31.
- Q6_K, super-blocks of 256 (210 bytes): 128 bytes `ql` (low nibbles), 64 bytes `qh` (two bits
  each), 16 int8 scales (sub-blocks of 16), f16 d; w = d * sc * (q - 32), q in 0..63.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14  # GGMLQuantizationType
QK_K = 256
# type -> (weights a block, bytes a block, weights a group of the decoded form)
LAYOUT = {Q4_0: (32, 18, 32), Q4_1: (32, 20, 32), Q5_0: (32, 22, 32), Q5_1: (32, 24, 32),
          Q8_0: (32, 34, 32), Q4_K: (QK_K, 144, 32), Q5_K: (QK_K, 176, 32),
          Q6_K: (QK_K, 210, 16)}
NAMES = {Q4_0: "q4_0", Q4_1: "q4_1", Q5_0: "q5_0", Q5_1: "q5_1", Q8_0: "q8_0", Q4_K: "q4_k",
         Q5_K: "q5_k", Q6_K: "q6_k"}
BITS = {Q4_0: 4, Q4_1: 4, Q5_0: 5, Q5_1: 5, Q8_0: 8, Q4_K: 4, Q5_K: 5, Q6_K: 6}


class Codes(NamedTuple):
    """A (rows, K) weight as codes: q (rows, K) uint8 (int8 for Q8_0), scale and offset
    (rows, K / group) float32; w = q * scale + offset per group."""

    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray

    @property
    def group(self) -> int:
        return self.q.shape[-1] // self.scale.shape[-1]

    def dequantize(self) -> np.ndarray:
        rows, k = self.q.shape
        q = self.q.astype(np.float32).reshape(rows, -1, self.group)
        return (q * self.scale[..., None] + self.offset[..., None]).reshape(rows, k)


def row_bytes(kind: int, k: int) -> int:
    weights, size, _ = LAYOUT[kind]
    if k % weights:
        raise ValueError(f"{NAMES[kind]} rows hold a multiple of {weights} weights, not {k}")
    return k // weights * size


def _half(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _k4_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> (scales, mins) (..., 8) as llama.cpp's get_scale_min_k4."""
    s = packed.astype(np.uint8)
    sc = np.empty((*s.shape[:-1], 8), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def decode_rows(kind: int, raw: np.ndarray) -> Codes:
    """The codes of raw blocks (..., bytes a row): the row length follows from the bytes; any
    leading dims are flattened into rows."""
    weights, size, _ = LAYOUT[kind]
    return decode(kind, raw.reshape(-1, raw.shape[-1]), raw.shape[-1] // size * weights)


def decode(kind: int, raw: np.ndarray, k: int) -> Codes:
    """The codes of raw blocks (rows, row_bytes(kind, k)) uint8."""
    weights, size, _ = LAYOUT[kind]
    rows = raw.shape[0]
    if raw.shape[-1] != row_bytes(kind, k):
        raise ValueError(f"{NAMES[kind]}: {raw.shape[-1]} bytes a row do not hold {k} weights")
    b = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, k // weights, size)
    if kind == Q4_0:
        d = _half(b[..., 0:2])
        nib = b[..., 2:]
        q = np.concatenate([nib & 0xF, nib >> 4], axis=-1)  # (rows, blocks, 32)
        return Codes(q.reshape(rows, k), d, -8 * d)
    if kind in (Q4_1, Q5_0, Q5_1):
        d = _half(b[..., 0:2])
        m = _half(b[..., 2:4]) if kind != Q5_0 else -16 * d
        at = 2 if kind == Q5_0 else 4
        if kind == Q4_1:
            nib, high = b[..., at:], None
        else:
            bits = b[..., at:at + 4].copy().view(np.uint32)  # (rows, blocks, 1), little-endian
            nib = b[..., at + 4:]
            high = ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = np.concatenate([nib & 0xF, nib >> 4], axis=-1)  # (rows, blocks, 32)
        if high is not None:
            q = q | (high << 4)
        return Codes(q.reshape(rows, k), d, m)
    if kind == Q8_0:
        d = _half(b[..., 0:2])
        q = b[..., 2:].view(np.int8)
        return Codes(np.ascontiguousarray(q).reshape(rows, k), d, np.zeros_like(d))
    if kind in (Q4_K, Q5_K):
        d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])
        sc, mn = _k4_scales(b[..., 4:16])  # (rows, blocks, 8)
        qs = b[..., 16 + (32 if kind == Q5_K else 0):].reshape(rows, -1, 4, 32)
        q = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(rows, -1, 8, 32)  # sub-block order
        if kind == Q5_K:
            qh = b[..., 16:48]  # (rows, blocks, 32): bit s of qh[l] for sub-block s
            fifth = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
            q = q | (fifth << 4)
        scale = (d[..., None] * sc).reshape(rows, -1)
        offset = -(dmin[..., None] * mn).reshape(rows, -1)
        return Codes(q.reshape(rows, k), scale, offset)
    if kind == Q6_K:
        ql = b[..., 0:128].reshape(rows, -1, 2, 64)  # per half of 128
        qh = b[..., 128:192].reshape(rows, -1, 2, 32)
        scales = b[..., 192:208].view(np.int8).astype(np.float32)  # (rows, blocks, 16)
        d = _half(b[..., 208:210])
        low = np.concatenate([ql & 0xF, ql >> 4], axis=-1)  # (rows, blocks, 2, 128): l, l+32, ..
        high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)  # same order
        q = (low | (high << 4)).reshape(rows, k)
        scale = (d[..., None] * scales).reshape(rows, -1)
        return Codes(q, scale, -32 * scale)
    raise ValueError(f"GGUF type {kind} has no decoder")
