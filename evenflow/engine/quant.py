"""Weight-only quantization: the numbers (quantizers), the stored forms and the matmul kernels.

Two methods, both weight-only (activations stay in the engine's dtype):
- int8: per output channel, symmetric. w[n, k] = q[n, k] * scale[n], q in [-128, 127].
- int4: per group of `group_size` input channels, with zero points (or symmetric).
  w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g], q in [0, 15], g = k // group_size.

`QuantValues` is the method-independent intermediate (our quantizer and the GPTQ reader both
produce it); a `QuantStack` holds one weight or a stack of experts' weights (E, N, K) in the
form its kernel reads, and `linear(x, e)` computes x @ w[e].T.

Kernels. torch has CPU weight-only kernels: `_weight_int8pack_mm` (int8, per-channel scales) and
`_weight_int4pack_mm_for_cpu` over `_convert_weight_to_int4pack_for_cpu`'s opaque blocked
layout. They win for few rows in bf16 and can lose badly elsewhere (many rows, or float32 on
some builds), so each shape is measured once on this machine at load (`KernelChoice`; kept in
a cache file, so every process on the machine makes the same choice):
- int8 keeps one stored form; up to `packed_max_rows` rows use the packed kernel, more rows
  dequantize the weight (one expert's, never all experts) and use the dense matmul.
- int4 must choose its stored form: the packed layout (kernel only) or plain nibbles (two
  values a byte, dequantized per call); whichever is faster for one row wins.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from evenflow.engine.config import check_quantization


@dataclass(frozen=True)
class QuantConfig:
    method: str  # int8 | int4
    group_size: int = 64  # int4 only
    symmetric: bool = False  # int4: no zero points
    quantize_lm_head: bool = False  # the embedding and lm_head stay unquantized by default

    def __post_init__(self) -> None:
        check_quantization(self.method, self.group_size)

    def fits(self, weight_shape: tuple[int, ...]) -> bool:
        """Whether a weight (..., N, K) can take this method (else it stays unquantized)."""
        n, k = weight_shape[-2], weight_shape[-1]
        if self.method == "int8":
            return n >= 16
        return n >= 16 and k % self.group_size == 0 and k % 2 == 0


@dataclass
class QuantValues:
    """w ≈ (q - zero) * scale, per group of K; q unsigned for int4, signed with zero None for
    int8 (one group: the whole row)."""

    bits: int
    q: Tensor  # (N, K) int8 (bits 8) or uint8 holding 0..15 (bits 4)
    scale: Tensor  # (N, G) float32
    zero: Tensor | None  # (N, G) float32, or None: symmetric around 0 (int8) / 8 (int4)

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def dequantize(self) -> Tensor:
        g = self.group_size
        q = self.q.float().view(self.q.shape[0], -1, g)
        zero = self.zero if self.zero is not None else torch.full_like(
            self.scale, 0.0 if self.bits == 8 else 8.0)
        return ((q - zero.unsqueeze(-1)) * self.scale.unsqueeze(-1)).view(self.q.shape)


def quantize(w: Tensor, config: QuantConfig) -> QuantValues:
    """Round-to-nearest quantization of one (N, K) weight."""
    w = w.float()
    if config.method == "int8":
        scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
        q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
        return QuantValues(8, q, scale, None)
    n, k = w.shape
    groups = w.view(n, k // config.group_size, config.group_size)
    if config.symmetric:
        scale = (groups.abs().amax(dim=-1) / 7.5).clamp(min=1e-12)  # q - 8 in [-8, 7]
        q = torch.round(groups / scale.unsqueeze(-1) + 8).clamp(0, 15)
        return QuantValues(4, q.to(torch.uint8).view(n, k), scale, None)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=1e-12)
    # An integer zero point, as GPTQ stores it; at least 1, since GPTQ's format stores zero - 1
    # in 4 bits (a group with no negative weight loses a little of its top end).
    zero = torch.round(-low / scale).clamp(1, 15)
    q = torch.round(groups / scale.unsqueeze(-1) + zero.unsqueeze(-1)).clamp(0, 15)
    return QuantValues(4, q.to(torch.uint8).view(n, k), scale, zero)


# ---- kernel choice, measured once per shape and dtype on this machine ----------------------

@dataclass(frozen=True)
class KernelChoice:
    packed_max_rows: int  # int8: rows up to this use the packed kernel; int4: 0 = nibbles form


_CHOICES: dict[tuple, KernelChoice] = {}
_PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64)


@functools.cache
def _choices_file(threads: int) -> Path:
    """Where this machine's measurements are kept, so every worker process on it makes the
    same choices (the kernels round differently: two workers must agree for a request that
    moves between them to continue identically). Keyed by CPU, torch version and threads."""
    try:  # the first processor's description: model name and flags
        cpu = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        cpu = ""
    key = hashlib.sha256(f"{cpu}|{torch.__version__}|{threads}".encode()).hexdigest()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "evenflow"
    return cache / f"kernel-choices-{key[:16]}.json"


@functools.cache
def _stored_choices(threads: int) -> dict[str, int]:
    """The file's choices, read once per process (and added to as shapes are measured)."""
    try:
        return {k: int(v) for k, v in json.loads(_choices_file(threads).read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def _save_choice(threads: int, key: str, value: int) -> None:
    known = _stored_choices(threads)
    known[key] = value
    try:
        path = _choices_file(threads)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, path)  # atomic: another process reads a whole file or the old one
    except OSError:  # a read-only home: measured again next time
        pass


def _time(fn, reps: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


Kernel = Callable[[Tensor], Tensor]


def _choose(key: tuple, candidates: Callable[[], tuple[Kernel, Kernel]], k: int,
            dtype: torch.dtype, rows: tuple[int, ...]) -> KernelChoice:
    """The choice for `key`: remembered, stored on disk, or measured with `candidates()`
    (packed kernel, alternative), built only when a measurement is needed."""
    if key not in _CHOICES:
        name, threads = "|".join(map(str, key)), torch.get_num_threads()
        limit = _stored_choices(threads).get(name)
        if limit is None:
            packed_fn, dense_fn = candidates()
            limit = 0
            for m in rows:
                x = torch.randn(m, k).to(dtype)
                if _time(lambda x=x: packed_fn(x)) > _time(lambda x=x: dense_fn(x)):
                    break
                limit = m
            _save_choice(threads, name, limit)
        _CHOICES[key] = KernelChoice(limit)
    return _CHOICES[key]


# ---- stored forms ----------------------------------------------------------------------------

class QuantStack:
    """One weight (E = 1) or E experts' weights of shape (N, K), quantized."""

    bits: int
    num: int
    out_features: int
    in_features: int

    def linear(self, x: Tensor, e: int = 0) -> Tensor:
        raise NotImplementedError

    def select(self, index: Tensor) -> QuantStack:
        """The stack of weights index[0], index[1], ... (expert placement: slots)."""
        raise NotImplementedError

    def nbytes(self) -> int:
        raise NotImplementedError


class Int8Stack(QuantStack):
    bits = 8

    def __init__(self, q: Tensor, scale: Tensor, choice: KernelChoice) -> None:
        self.q, self.scale, self.choice = q, scale, choice  # (E, N, K) int8, (E, N) dtype
        self.num, self.out_features, self.in_features = q.shape

    @classmethod
    def build(cls, values: list[QuantValues], dtype: torch.dtype) -> Int8Stack:
        q = torch.stack([v.q for v in values]).contiguous()
        scale = torch.stack([v.scale[:, 0] for v in values]).to(dtype).contiguous()
        n, k = q.shape[1:]
        stack = cls(q, scale, KernelChoice(0))
        stack.choice = _choose(("int8", n, k, dtype), lambda: (
            lambda x: torch._weight_int8pack_mm(x, q[0], scale[0]),
            lambda x: F.linear(x, q[0].to(dtype)) * scale[0]), k, dtype, _PROBE_ROWS)
        return stack

    def linear(self, x: Tensor, e: int = 0) -> Tensor:
        if x.shape[0] <= self.choice.packed_max_rows:
            return torch._weight_int8pack_mm(x, self.q[e], self.scale[e])
        # int8 values are exact in bf16: the per-channel scale goes on the output (one pass
        # over the weight fewer)
        return F.linear(x, self.q[e].to(x.dtype)) * self.scale[e]

    def select(self, index: Tensor) -> Int8Stack:
        return Int8Stack(self.q.index_select(0, index), self.scale.index_select(0, index),
                         self.choice)

    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


class Int4Stack(QuantStack):
    """Either torch's packed layout (`packed`, with `scale_zeros` (E, G, N, 2): the kernel's
    w = (q - 8) * scale + zero form) or plain nibbles (`nibbles` (E, N, K/2), even k in the
    low half, with `scale` and `offset` (E, N, G): w = q * scale + offset)."""

    bits = 4

    def __init__(self, group_size: int, num: int, n: int, k: int, *,
                 packed: Tensor | None = None, scale_zeros: Tensor | None = None,
                 nibbles: Tensor | None = None, scale: Tensor | None = None,
                 offset: Tensor | None = None) -> None:
        self.group_size, self.num, self.out_features, self.in_features = group_size, num, n, k
        self.packed, self.scale_zeros = packed, scale_zeros
        self.nibbles, self.scale, self.offset = nibbles, scale, offset

    @classmethod
    def build(cls, values: list[QuantValues], dtype: torch.dtype) -> Int4Stack:
        n, k = values[0].q.shape
        g = values[0].group_size
        scale = torch.stack([v.scale for v in values])  # (E, N, G) float32
        zero = torch.stack([v.zero if v.zero is not None else torch.full_like(v.scale, 8.0)
                            for v in values])
        offset = -zero * scale  # w = q * scale + offset
        choice = _choose(("int4", n, k, g, dtype), lambda: (
            cls._packed(values[:1], scale[:1], offset[:1], dtype).linear,
            cls._plain(values[:1], scale[:1], offset[:1], dtype).linear), k, dtype, (1,))
        if choice.packed_max_rows:
            return cls._packed(values, scale, offset, dtype)
        return cls._plain(values, scale, offset, dtype)

    @classmethod
    def _packed(cls, values: list[QuantValues], scale: Tensor, offset: Tensor,
                dtype: torch.dtype) -> Int4Stack:
        n, k = values[0].q.shape
        packed = torch.stack([torch._convert_weight_to_int4pack_for_cpu(v.q.to(torch.int32), 1)
                              for v in values])
        # kernel form: w = (q - 8) * scale + zero  =>  zero = offset + 8 * scale
        scale_zeros = torch.stack([scale, offset + 8 * scale], dim=-1)  # (E, N, G, 2)
        scale_zeros = scale_zeros.transpose(1, 2).to(dtype).contiguous()  # (E, G, N, 2)
        return cls(values[0].group_size, len(values), n, k, packed=packed,
                   scale_zeros=scale_zeros)

    @classmethod
    def _plain(cls, values: list[QuantValues], scale: Tensor, offset: Tensor,
               dtype: torch.dtype) -> Int4Stack:
        n, k = values[0].q.shape
        q = torch.stack([v.q for v in values])  # (E, N, K) uint8
        nibbles = (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()
        return cls(values[0].group_size, len(values), n, k, nibbles=nibbles,
                   scale=scale.to(dtype).contiguous(), offset=offset.to(dtype).contiguous())

    def dequantize(self, e: int, dtype: torch.dtype) -> Tensor:
        assert self.nibbles is not None and self.scale is not None and self.offset is not None
        b = self.nibbles[e]
        q = torch.stack([b & 0xF, b >> 4], dim=-1).view(self.out_features, -1, self.group_size)
        w = q.to(dtype) * self.scale[e].unsqueeze(-1) + self.offset[e].unsqueeze(-1)
        return w.view(self.out_features, self.in_features)

    def linear(self, x: Tensor, e: int = 0) -> Tensor:
        if self.packed is not None:
            assert self.scale_zeros is not None
            return torch._weight_int4pack_mm_for_cpu(x, self.packed[e], self.group_size,
                                                     self.scale_zeros[e])
        return F.linear(x, self.dequantize(e, x.dtype))

    def select(self, index: Tensor) -> Int4Stack:
        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.index_select(0, index)

        return Int4Stack(self.group_size, len(index), self.out_features, self.in_features,
                         packed=pick(self.packed), scale_zeros=pick(self.scale_zeros),
                         nibbles=pick(self.nibbles), scale=pick(self.scale),
                         offset=pick(self.offset))

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.packed, self.scale_zeros, self.nibbles, self.scale,
                                      self.offset) if t is not None)


def build_stack(values: list[QuantValues], dtype: torch.dtype) -> QuantStack:
    """The stored form for these weights (all of one shape and method)."""
    if values[0].bits == 8:
        return Int8Stack.build(values, dtype)
    return Int4Stack.build(values, dtype)
