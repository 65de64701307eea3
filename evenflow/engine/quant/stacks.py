"""Quantization: the numbers (quantizers), the stored forms and the matmul kernels.

Two weight-only methods (activations stay in the engine's dtype) and one that quantizes the
activations too:
- int8: per output channel, symmetric. w[n, k] = q[n, k] * scale[n], q in [-128, 127].
- int4: per group of `group_size` input channels, with zero points (or symmetric).
  w[n, k] = (q[n, k] - zero[n, g]) * scale[n, g], q in [0, 15], g = k // group_size.
- w8a8: int8's weights, and each activation row quantized to int8 as it arrives (dynamic, per
  token, symmetric: `quantize_rows`), so the matmul runs on integer dot products (VNNI's
  vpdpbusd in the panel kernels, engine/kernels/panel_quant.h; torch._int_mm elsewhere:
  `W8A8Stack`). vLLM calls it W8A8 int8 (compressed-tensors' "int-quantized" format with dynamic
  per-token input activations).

`QuantValues` is the method-independent intermediate (our quantizer and the GPTQ reader both
produce it); a `QuantStack` holds one weight or a stack of experts' weights (E, N, K) in the
form its kernel reads, and `linear(x, e)` computes x @ w[e].T.

Kernels. Three for each form, and each shape picks among them by measuring once on this
machine at load (`KernelChoice`, kept in a cache file so every process on the machine makes the
same choice: the kernels round differently, and a request that moves between two workers must
continue identically):
- torch's packed kernels, `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` (over
  `_convert_weight_to_int4pack_for_cpu`'s opaque layout): fastest for one row, but they convert
  the weight again for every row, so their time grows linearly with the rows;
- our own (engine/kernels/native.py, engine/kernels/weight_only.cpp): dequantizes a tile once into
  L1 and lets every row read it (bf16 dot-product instructions where the CPU has them): wins from a
  few rows up to a few dozen;
- dequantize the weight (one expert's, never all experts) and use the dense matmul: many rows.
int4 must also choose its stored form: torch's packed layout (its kernel only) or plain
nibbles (two values a byte; our kernel or dequantize-then-matmul): whichever is faster for one
row wins.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from evenflow.engine.config.settings import check_quantization
from evenflow.engine.kernels.plan import (
    DENSE,
    NATIVE,
    PACKED,
    PROBE_ROWS,
    Kernel,
    KernelChoice,
    choose,
    native_ops,
)


@dataclass(frozen=True)
class QuantConfig:
    method: str  # int8 | int4 | w8a8
    group_size: int = 64  # int4 only
    symmetric: bool = False  # int4: no zero points
    quantize_lm_head: bool = False  # the embedding and lm_head stay unquantized by default
    # a regular expression: modules whose name it finds stay unquantized (quant_skip)
    skip: str = ""
    # the attention projections' method: "same" as the rest, another one, or "none" (left in
    # the engine's dtype): quant_attention, whose "auto" is ATTENTION_BY_METHOD's
    attention: str = "same"

    def __post_init__(self) -> None:
        check_quantization(self.method, self.group_size)
        if self.skip:
            try:
                re.compile(self.skip)
            except re.error as exc:
                raise ValueError(f"quant_skip is not a regular expression: {exc}") from None

    def for_module(self, name: str) -> QuantConfig | None:
        """The config for the layer's module `name` (`self_attn.o_proj`, `mlp.w13`): the
        attention projections' own method (None: left unquantized)."""
        if not name.startswith("self_attn.") or self.attention == "same":
            return self
        if self.attention == "none":
            return None
        return dataclasses.replace(self, method=self.attention, attention="same")

    def takes(self, name: str) -> bool:
        """Whether the module `name` (`model.layers.3.self_attn.o_proj`,
        `model.layers.3.mlp.experts`, `lm_head`) is quantized (quant_skip leaves it alone)."""
        return not self.skip or re.search(self.skip, name) is None

    def fits(self, weight_shape: tuple[int, ...]) -> bool:
        """Whether a weight (..., N, K) can take this method (else it stays unquantized)."""
        n, k = weight_shape[-2], weight_shape[-1]
        if self.method == "int8":
            return n >= 16
        if self.method == "w8a8":  # (the integer dot product takes inputs four at a time)
            return n >= 16 and k % 4 == 0
        return n >= 16 and k % self.group_size == 0 and k % 2 == 0


# quant_attention "auto": where the attention projections go for each method. Measured on the
# random 110M Mixtral (`evenflow bench quant`, 100 prompts, greedy agreement with bf16 against
# float32's 76.4%): int8 everywhere 69.9, int8 on attention alone 68.4, on the experts alone
# 74.3 (v_proj and o_proj, which write the residual stream, carry the loss: q/k alone 76.1);
# w8a8 66.4 / 68.1 / 73.3; int4-g64 34.0, with attention left in bf16 57.4. Attention is ~5%
# of a MoE model's weights and 10-20% of a decode step's bytes.
ATTENTION_BY_METHOD = {"int8": "none", "w8a8": "none", "int4": "int8"}


@dataclass
class QuantValues:
    """w ≈ (q - zero) * scale, per group of K; q unsigned for int4, signed with zero None for
    int8 (one group: the whole row). `int8_activations`: the activations meeting this weight are
    quantized per token too (w8a8)."""

    bits: int
    q: Tensor  # (N, K) int8 (bits 8) or uint8 holding 0..15 (bits 4) / 0..31 (bits 5: GGUF's)
    scale: Tensor  # (N, G) float32
    zero: Tensor | None  # (N, G) float32, or None: symmetric around 0 (int8) / 8 (int4)
    int8_activations: bool = False

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
    # In place on one float32 copy: a load quantizing as it reads holds one weight's worth of
    # temporaries, not five.
    w = w.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    if config.method in ("int8", "w8a8"):
        scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
        # (w8a8 keeps to [-127, 127]: symmetric, as compressed-tensors' int8 weights are)
        bottom = -127 if config.method == "w8a8" else -128
        q = w.div_(scale).round_().clamp_(bottom, 127).to(torch.int8)
        return QuantValues(8, q, scale, None, config.method == "w8a8")
    n, k = w.shape
    groups = w.view(n, k // config.group_size, config.group_size)
    if config.symmetric:
        scale = (groups.abs().amax(dim=-1) / 7.5).clamp(min=1e-12)  # q - 8 in [-8, 7]
        q = groups.div_(scale.unsqueeze(-1)).add_(8).round_().clamp_(0, 15)
        return QuantValues(4, q.to(torch.uint8).view(n, k), scale, None)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=1e-12)
    # An integer zero point, as GPTQ stores it; at least 1, since GPTQ's format stores zero - 1
    # in 4 bits (a group with no negative weight loses a little of its top end).
    zero = torch.round(-low / scale).clamp(1, 15)
    q = groups.div_(scale.unsqueeze(-1)).add_(zero.unsqueeze(-1)).round_().clamp_(0, 15)
    return QuantValues(4, q.to(torch.uint8).view(n, k), scale, zero)


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


class StoredStack(QuantStack):
    """E weights kept as a checkpoint stores them: `values` (E, N, ...) and `scales` (E, N, ...)
    stacked; a call dequantizes its weight and runs the dense matmul. The torch fallback of the
    compact forms (engine/quant/mxfp4.py, fp8.py) where their panels do not serve."""

    def __init__(self, values: Tensor, scales: Tensor, in_features: int) -> None:
        self.values, self.scales = values, scales
        self.num, self.out_features, self.in_features = values.shape[0], values.shape[1], \
            in_features

    @classmethod
    def stacked(cls, pairs: list[tuple[Tensor, Tensor]]) -> StoredStack:
        return cls(torch.stack([v for v, _ in pairs]).contiguous(),
                   torch.stack([s for _, s in pairs]).contiguous())  # type: ignore[call-arg]

    def dequantize(self, e: int, dtype: torch.dtype) -> Tensor:
        raise NotImplementedError

    def linear(self, x: Tensor, e: int = 0) -> Tensor:
        return F.linear(x, self.dequantize(e, x.dtype))

    def select(self, index: Tensor) -> StoredStack:
        return type(self)(self.values.index_select(0, index),  # type: ignore[call-arg]
                          self.scales.index_select(0, index))

    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes


class Int8Stack(QuantStack):
    bits = 8

    def __init__(self, q: Tensor, scale: Tensor, choice: KernelChoice) -> None:
        self.q, self.scale, self.choice = q, scale, choice  # (E, N, K) int8, (E, N) dtype
        self.num, self.out_features, self.in_features = q.shape
        self.ops = native_ops(scale.dtype, self.in_features) if choice.uses_native else None
        # our kernel reads float32 scales (a copy: 4 bytes per output channel)
        self.scale_f32 = scale.float().contiguous() if self.ops is not None else None

    @classmethod
    def build(cls, values: list[QuantValues], dtype: torch.dtype) -> Int8Stack:
        q = torch.stack([v.q for v in values]).contiguous()
        scale = torch.stack([v.scale[:, 0] for v in values]).to(dtype).contiguous()
        n, k = q.shape[1:]
        ops = native_ops(dtype, k)

        def candidates() -> dict[int, Kernel]:
            kernels: dict[int, Kernel] = {
                PACKED: lambda x: torch._weight_int8pack_mm(x, q[0], scale[0]),
                DENSE: lambda x: F.linear(x, q[0].to(dtype)) * scale[0]}
            if ops is not None:
                scale32 = scale[0].float().contiguous()
                kernels[NATIVE] = lambda x: ops.int8_mm(x, q[0], scale32)
            return kernels

        choice = choose(("int8", n, k, dtype, ops is not None), candidates, k, dtype,
                         PROBE_ROWS)
        return cls(q, scale, choice)

    def linear(self, x: Tensor, e: int = 0) -> Tensor:
        kernel = self.choice.kernel(x.shape[0])
        if kernel == PACKED:
            return torch._weight_int8pack_mm(x, self.q[e], self.scale[e])
        if kernel == NATIVE and self.ops is not None:
            assert self.scale_f32 is not None
            return self.ops.int8_mm(x.contiguous(), self.q[e], self.scale_f32[e])
        # int8 values are exact in bf16: the per-channel scale goes on the output (one pass
        # over the weight fewer)
        return F.linear(x, self.q[e].to(x.dtype)) * self.scale[e]

    def select(self, index: Tensor) -> Int8Stack:
        return Int8Stack(self.q.index_select(0, index), self.scale.index_select(0, index),
                         self.choice)

    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes + (
            self.scale_f32.nbytes if self.scale_f32 is not None else 0)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Each row of x (M, K) as int8 and its float32 scale (M, 1): x ~ q * scale, scale =
    max|x| / 127, q = round(x * 127 / max|x|) (half to even), as the native kernels quantize
    (engine/kernels/panel_quant.h: quantize_rows); a zero row gets scale 0."""
    x = x.float()
    peak = x.abs().amax(dim=1, keepdim=True)
    inv = torch.where(peak > 0, 127.0 / peak, torch.zeros_like(peak))
    return torch.round(x * inv).to(torch.int8), peak / 127.0


class W8A8Stack(QuantStack):
    """w8a8 on torch's integer matmul (torch._int_mm): where the VNNI panel kernels do not serve
    (engine/quant/panel_stack.py). q_t (E, K, N) int8 (the layout _int_mm reads), scale (E, N)
    float32."""

    bits = 8

    def __init__(self, q_t: Tensor, scale: Tensor) -> None:
        self.q_t, self.scale = q_t, scale
        self.num, self.in_features, self.out_features = q_t.shape

    @classmethod
    def build(cls, values: list[QuantValues]) -> W8A8Stack:
        return cls(torch.stack([v.q.T for v in values]).contiguous(),
                   torch.stack([v.scale[:, 0].float() for v in values]).contiguous())

    def linear(self, x: Tensor, e: int = 0) -> Tensor:
        flat = x.reshape(-1, self.in_features)
        q, row_scale = quantize_rows(flat)
        sums = torch._int_mm(q, self.q_t[e]).float()
        out = sums * (self.scale[e].unsqueeze(0) * row_scale)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def select(self, index: Tensor) -> W8A8Stack:
        return W8A8Stack(self.q_t.index_select(0, index), self.scale.index_select(0, index))

    def nbytes(self) -> int:
        return self.q_t.nbytes + self.scale.nbytes


class Int4Stack(QuantStack):
    """Either torch's packed layout (`packed`, with `scale_zeros` (E, G, N, 2): the kernel's
    w = (q - 8) * scale + zero form) or plain nibbles (`nibbles` (E, N, K/2), even k in the
    low half, with `scale` and `offset` (E, N, G): w = q * scale + offset; float32 copies of
    both when our kernel reads them)."""

    bits = 4

    def __init__(self, group_size: int, num: int, n: int, k: int, *,
                 packed: Tensor | None = None, scale_zeros: Tensor | None = None,
                 nibbles: Tensor | None = None, scale: Tensor | None = None,
                 offset: Tensor | None = None, choice: KernelChoice | None = None) -> None:
        self.group_size, self.num, self.out_features, self.in_features = group_size, num, n, k
        self.packed, self.scale_zeros = packed, scale_zeros
        self.nibbles, self.scale, self.offset = nibbles, scale, offset
        self.choice = choice or KernelChoice((PACKED,) if packed is not None else (DENSE,))
        self.ops = None
        self.scale_f32 = self.offset_f32 = None
        if nibbles is not None and self.choice.uses_native:
            assert scale is not None and offset is not None
            self.ops = native_ops(scale.dtype, k) if 512 % group_size == 0 else None
            if self.ops is not None:
                self.scale_f32 = scale.float().contiguous()
                self.offset_f32 = offset.float().contiguous()

    @classmethod
    def build(cls, values: list[QuantValues], dtype: torch.dtype) -> Int4Stack:
        n, k = values[0].q.shape
        g = values[0].group_size
        scale, offset = cls.scale_offset(values)
        ops = native_ops(dtype, k) if 512 % g == 0 else None

        def plain_kernels() -> dict[int, Kernel]:
            one = cls._plain(values[:1], scale[:1], offset[:1], dtype,
                             KernelChoice((NATIVE,)) if ops is not None else None)
            return {DENSE: one._dense, **({NATIVE: one._native} if ops is not None else {})}

        form = choose(("int4", n, k, g, dtype, ops is not None), lambda: {
            PACKED: cls._packed(values[:1], scale[:1], offset[:1], dtype).linear,
            **plain_kernels()}, k, dtype, (1,))
        if form.plan == (PACKED,):
            return cls._packed(values, scale, offset, dtype)
        plan = choose(("int4 nibbles", n, k, g, dtype, ops is not None), plain_kernels, k,
                       dtype, PROBE_ROWS)
        return cls._plain(values, scale, offset, dtype, plan)

    @staticmethod
    def scale_offset(values: list[QuantValues]) -> tuple[Tensor, Tensor]:
        """(E, N, G) float32 scale and offset: w = q * scale + offset."""
        scale = torch.stack([v.scale for v in values])
        zero = torch.stack([v.zero if v.zero is not None else torch.full_like(v.scale, 8.0)
                            for v in values])
        return scale, -zero * scale

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
               dtype: torch.dtype, choice: KernelChoice | None = None) -> Int4Stack:
        n, k = values[0].q.shape
        q = torch.stack([v.q for v in values])  # (E, N, K) uint8
        nibbles = (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()
        return cls(values[0].group_size, len(values), n, k, nibbles=nibbles,
                   scale=scale.to(dtype).contiguous(), offset=offset.to(dtype).contiguous(),
                   choice=choice)

    def dequantize(self, e: int, dtype: torch.dtype) -> Tensor:
        assert self.nibbles is not None and self.scale is not None and self.offset is not None
        b = self.nibbles[e]
        q = torch.stack([b & 0xF, b >> 4], dim=-1).view(self.out_features, -1, self.group_size)
        w = q.to(dtype) * self.scale[e].unsqueeze(-1) + self.offset[e].unsqueeze(-1)
        return w.view(self.out_features, self.in_features)

    def _dense(self, x: Tensor, e: int = 0) -> Tensor:
        return F.linear(x, self.dequantize(e, x.dtype))

    def _native(self, x: Tensor, e: int = 0) -> Tensor:
        assert self.ops is not None and self.nibbles is not None
        assert self.scale_f32 is not None and self.offset_f32 is not None
        return self.ops.int4_mm(x.contiguous(), self.nibbles[e], self.scale_f32[e],
                                self.offset_f32[e], self.group_size)

    def linear(self, x: Tensor, e: int = 0) -> Tensor:
        if self.packed is not None:
            assert self.scale_zeros is not None
            # (the op wants a contiguous x: MLA's attention output reaches o_proj as a view)
            return torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed[e],
                                                     self.group_size, self.scale_zeros[e])
        if self.ops is not None and self.choice.kernel(x.shape[0]) == NATIVE:
            return self._native(x, e)
        return self._dense(x, e)

    def select(self, index: Tensor) -> Int4Stack:
        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.index_select(0, index)

        return Int4Stack(self.group_size, len(index), self.out_features, self.in_features,
                         packed=pick(self.packed), scale_zeros=pick(self.scale_zeros),
                         nibbles=pick(self.nibbles), scale=pick(self.scale),
                         offset=pick(self.offset), choice=self.choice)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.packed, self.scale_zeros, self.nibbles, self.scale,
                                      self.offset, self.scale_f32, self.offset_f32)
                   if t is not None)
