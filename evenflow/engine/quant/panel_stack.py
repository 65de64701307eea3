"""Weight-only quantized weights in the panel layout of the native panel kernels
(engine/kernels/panel_quant.h): what `quant.build_stack` makes wherever those kernels serve.

A `PanelStack` holds E weights (N, K), each as its own tensors (so an expert placement selects
slots by reference, without copies):
- int8: (N/64, K, 64) int8 and a float32 scale per output channel (N,);
- int4: (N/64, K/2, 64) uint8 (byte (kp, c): k = 2kp in the low nibble, 2kp + 1 in the high),
  with float32 scale and offset (N/64, G, 64): w = q * scale + offset; where VNNI is (and
  EVENFLOW_NATIVE_W4A8 is on), (N/64, K/8, 64, 4) instead: the dword of (block j, channel c)
  holds k = 8j + i in byte i's low nibble and 8j + 4 + i in its high one, for the W4A8 kernel
  (rows quantized to int8 per group meet it on vpdpbusd: panel_w8a8.h), with the scale and
  offset in float16;
- int5 (GGUF's 5-bit types as stored; only where the W4A8 layout is): (N/64, K/8, 5, 64) uint8,
  per block j of 8 inputs int4's 64 dwords of the codes' low four bits, then a byte per channel
  whose bit i is the fifth bit of k = 8j + i; scale and offset as int4's VNNI layout: 6 bits a
  weight;
- mxfp4 (engine/quant/mxfp4.py; where VNNI is and EVENFLOW_NATIVE_W4A8 is on): the E2M1 codes
  in int4's VNNI layout, with each (group of 32, channel)'s E8M0 exponent byte (N/64, G, 64)
  uint8 in the scale's place and no offset: 4.25 bits a weight, as the checkpoint ships it;
- fp8 (engine/quant/fp8.py): (N/64, K, 64) float8_e4m3fn as stored, with a float32 scale per
  (block of 128 inputs, channel) (N/64, ceil(K/128), 64);
- w8a8: (N/64, K/4, 64, 4) int8 (four consecutive inputs of a channel side by side: VNNI's
  vpdpbusd), a float32 scale per output channel (N,) and, in the offset's place, an int32
  comp (N,) = 128 * sum_k q[n, k] (the kernel's activations are unsigned, offset by 128).
A MoE layer's gate_up stack has its channels interleaved as engine/kernels/panels.py describes
(panel p: gate [32p, 32p + 32), then up); `linear` returns them in the plain order again.

int8 (weight-only) takes w8a8's layout where VNNI is (EVENFLOW_NATIVE_INT8_ROWS, on by
default): its rows may then meet the codes as int8 rows (quantized per token, w8a8's kernel) or
a dequantized panel, exact in the activations' dtype.

Which of a panel's two ways serves a block of rows — the codes read directly (float rows, or
int8 rows where the form takes them) or the panel dequantized once into a plain panel for the
dot-product kernel — is measured once per form, shape, dtype and thread count on this machine
(engine/kernels/plan.py: PANEL_PROBE_ROWS, kept in the kernel-plan file, so every process on
the machine makes the same choice) and passed to the kernels as the row count from which the
panel is dequantized (`dequant_from`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from evenflow.engine.config.settings import switched_on
from evenflow.engine.kernels import native, panels
from evenflow.engine.kernels.plan import (
    NEVER_DEQUANT,
    PANEL_PROBE_ROWS,
    ROWS_DEQUANT,
    ROWS_DIRECT,
    dequant_from,
    measured_plan,
)
from evenflow.engine.quant.fp8 import Fp8Values
from evenflow.engine.quant.mxfp4 import Mxfp4Values
from evenflow.engine.quant.stacks import QuantStack, QuantValues

Values = QuantValues | Mxfp4Values | Fp8Values

PANEL = panels.PANEL


def usable(values: list[Values], dtype: torch.dtype, gate_up: bool = False) -> bool:
    """The panel kernels take these weights and activations here (a gate_up stack: gate and
    up each a whole number of panels)."""
    first = values[0]
    n, k = first.shape if isinstance(first, Mxfp4Values) else first.q.shape
    if not native.built_for_avx512():  # (the quantized panels' loops are AVX-512's)
        return False
    if isinstance(first, Mxfp4Values) and not w4a8_layout(first.group_size, k):
        return False
    if isinstance(first, Fp8Values) and gate_up and n % (2 * PANEL):
        return False
    if values[0].int8_activations and (k % 4 or not native.w8a8_supported()):
        return False
    if isinstance(first, QuantValues) and first.bits == 8 and int8_rows() and k % 4:
        return False  # (int8 in w8a8's layout: the integer dot product takes inputs by four)
    if values[0].bits == 4 and values[0].group_size % 2 or gate_up and n % (2 * PANEL):
        return False
    if values[0].bits == 5 and not w4a8_layout(values[0].group_size, k):
        return False
    return panels.usable(dtype, PANEL, PANEL) and panels.linear_usable(dtype, n, k)


def w4a8_layout(group_size: int, k: int) -> bool:
    """int4 goes into the VNNI layout (the W4A8 kernel for few rows) here."""
    return group_size % 8 == 0 and k % 8 == 0 and native.w8a8_supported() and \
        switched_on("EVENFLOW_NATIVE_W4A8")


def int8_rows() -> bool:
    """int8 (weight-only) goes into w8a8's layout here, so that its rows may meet the codes as
    int8 rows where that measures faster (VNNI's integer dot product)."""
    return native.w8a8_supported() and switched_on("EVENFLOW_NATIVE_INT8_ROWS")


def _interleave(t: Tensor) -> Tensor:
    """Rows (2I, ...) of a gate_up weight in panel order: per 32, gate then up."""
    half = t.shape[0] // 2
    gate, up = t.view(2, half // (PANEL // 2), PANEL // 2, *t.shape[1:]).unbind(0)
    return torch.stack([gate, up], dim=1).reshape(t.shape)


def _vnni_nibbles(q: Tensor) -> Tensor:
    """(N, K) values 0..15 -> (N/64, K/8, 64, 4) uint8: the dword of (block j, channel c) holds
    k = 8j + i in byte i's low nibble and 8j + 4 + i in its high one."""
    n, k = q.shape
    eights = q.view(n // PANEL, PANEL, k // 8, 2, 4)  # [panel, c, j, half, i]
    return (eights[:, :, :, 0] | (eights[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()


def _vnni_five(q: Tensor) -> Tensor:
    """(N, K) values 0..31 -> (N/64, K/8, 5, 64) uint8: per block of 8 inputs, the low four
    bits as `_vnni_nibbles` lays them out (256 bytes), then a byte per channel whose bit i is
    the fifth bit of k = 8j + i."""
    n, k = q.shape
    dwords = _vnni_nibbles(q & 0xF).view(n // PANEL, k // 8, 4, PANEL)
    fifth = (q >> 4).view(n // PANEL, PANEL, k // 8, 8).permute(0, 2, 1, 3)  # [panel, j, c, i]
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    bits = (fifth * weights).sum(dim=-1, dtype=torch.uint8).unsqueeze(2)  # distinct bits: OR
    return torch.cat([dwords, bits], dim=2).contiguous()


def _pack_mxfp4(v: Mxfp4Values, gate_up: bool) -> tuple[Tensor, Tensor, None]:
    codes, exponents = v.codes(), v.scales
    if gate_up:
        codes, exponents = _interleave(codes), _interleave(exponents)
    n, groups = exponents.shape
    by_panel = exponents.view(n // PANEL, PANEL, groups).permute(0, 2, 1).contiguous()
    return _vnni_nibbles(codes), by_panel, None


def _pack_fp8(v: Fp8Values, gate_up: bool) -> tuple[Tensor, Tensor, None]:
    q, scale = v.q.view(torch.uint8), v.scale.float()
    if gate_up:
        q, scale = _interleave(q), _interleave(scale)
    n, k = q.shape
    blocks = scale.shape[1]
    data = q.view(n // PANEL, PANEL, k).permute(0, 2, 1).contiguous()
    return data.view(torch.float8_e4m3fn), \
        scale.view(n // PANEL, PANEL, blocks).permute(0, 2, 1).contiguous(), None


def _pack(v: Values, gate_up: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    if isinstance(v, Mxfp4Values):
        return _pack_mxfp4(v, gate_up)
    if isinstance(v, Fp8Values):
        return _pack_fp8(v, gate_up)
    q, scale = v.q, v.scale.float()
    n, k = q.shape
    zero = v.zero if v.zero is not None else torch.full_like(scale, 0.0 if v.bits == 8 else 8.0)
    if gate_up:
        q, scale, zero = _interleave(q), _interleave(scale), _interleave(zero.float())
    if v.int8_activations or v.bits == 8 and int8_rows():
        comp = q.sum(dim=1, dtype=torch.int32).mul_(128).contiguous()
        return q.view(n // PANEL, PANEL, k // 4, 4).permute(0, 2, 1, 3).contiguous(), \
            scale[:, 0].contiguous(), comp
    if v.bits == 8:
        return q.view(n // PANEL, PANEL, k).permute(0, 2, 1).contiguous(), \
            scale[:, 0].contiguous(), None
    groups = scale.shape[1]
    w4a8 = w4a8_layout(v.group_size, k)
    if v.bits == 5:  # (`usable` checked the layout)
        nibbles = _vnni_five(q)
    elif w4a8:
        nibbles = _vnni_nibbles(q)
    else:
        pairs = q.view(n // PANEL, PANEL, k // 2, 2).permute(0, 2, 1, 3)  # (N/64, K/2, 64, 2)
        nibbles = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()

    def by_panel(t: Tensor) -> Tensor:  # (the W4A8 layout's in float16: half the bytes)
        panel_order = t.view(n // PANEL, PANEL, groups).permute(0, 2, 1)
        return (panel_order.half() if w4a8 else panel_order).contiguous()

    return nibbles, by_panel(scale), by_panel(-zero * scale)


def _form_name(v: Values) -> str:
    """The stored form, for the kernel plans' keys and `bench quant`'s table."""
    if isinstance(v, Mxfp4Values):
        return "mxfp4"
    if isinstance(v, Fp8Values):
        return "fp8"
    if v.int8_activations:
        return "w8a8"
    if v.bits == 8:
        return "int8 rows" if int8_rows() else "int8"
    if v.bits == 5:
        return "int5"
    return "int4 vnni" if w4a8_layout(v.group_size, v.q.shape[1]) else "int4"


class PanelStack(QuantStack):
    def __init__(self, bits: int, group_size: int, n: int, k: int, data: list[Tensor],
                 scale: list[Tensor], offset: list[Tensor] | None, gate_up: bool,
                 form: str = "", dequant_from: int = 0) -> None:
        """`offset`: int4's offsets, w8a8's comps (int32), None for int8. `dequant_from`: the
        kernel plan's row count from which a panel is dequantized first (0: the kernels'
        built-in thresholds)."""
        self.bits, self.group_size, self.gate_up = bits, group_size, gate_up
        self.num, self.out_features, self.in_features = len(data), n, k
        self.data, self.scale, self.offset = data, scale, offset
        self.form, self.dequant_from = form, dequant_from

    @classmethod
    def build(cls, values: list[Values], gate_up: bool = False, consume: bool = False,
              dtype: torch.dtype | None = None) -> PanelStack:
        """`consume`: empty `values` as each is packed (a load then never holds a layer's
        unpacked values next to its packed ones). `dtype`: the activations', for the kernel
        plan (measured on the first weight; None: the kernels' built-in thresholds)."""
        first = values[0]
        n, k = first.shape if isinstance(first, Mxfp4Values) else first.q.shape
        bits = first.bits
        group_size = first.group_size if bits in (4, 5) or isinstance(first, Fp8Values) else 0
        form = _form_name(first)
        if consume:
            packed = []
            while values:
                packed.append(_pack(values.pop(0), gate_up))
        else:
            packed = [_pack(v, gate_up) for v in values]
        offsets = [o for _, _, o in packed if o is not None]
        stack = cls(bits, group_size, n, k, [d for d, _, _ in packed],
                    [s for _, s, _ in packed], offsets or None, gate_up, form)
        if dtype is not None and switched_on("EVENFLOW_KERNEL_PLANS"):
            stack.dequant_from = dequant_from(stack.plan(dtype))
        return stack

    def plan(self, dtype: torch.dtype) -> tuple[int, ...]:
        """This form and shape's way at each of PANEL_PROBE_ROWS (ROWS_DIRECT / ROWS_DEQUANT):
        the machine's stored plan, or measured now on the first weight."""
        data, scale = self.data[0], self.scale[0]
        offset = self.offset[0] if self.offset is not None else None

        def way(threshold: int):
            word = panels.group_word(self.group_size, threshold)
            return lambda x: torch.ops.evenflow_kernels.panel_linear(x, data, None, scale,
                                                                     offset, word)

        key = ("panel", self.form, self.out_features, self.in_features, self.group_size,
               str(dtype).removeprefix("torch."))
        return measured_plan(key, lambda: {ROWS_DIRECT: way(NEVER_DEQUANT),
                                           ROWS_DEQUANT: way(1)},
                             self.in_features, dtype, PANEL_PROBE_ROWS)

    def kernel_args(self, e: int = 0) -> tuple:
        """panel_linear's arguments after x for weight e (the weight, bias, scale, offset,
        group word); its outputs in panel order (a gate_up stack's interleaved)."""
        return (self.data[e], None, self.scale[e],
                self.offset[e] if self.offset is not None else None,
                panels.group_word(self.group_size, self.dequant_from))

    def linear(self, x: Tensor, e: int = 0) -> Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        out = torch.ops.evenflow_kernels.panel_linear(flat, *self.kernel_args(e))
        if self.gate_up:  # back to gate channels, then up channels
            rows = out.shape[0]
            out = out.view(rows, -1, 2, PANEL // 2).transpose(1, 2).reshape(rows, -1)
        return out.view(*x.shape[:-1], self.out_features)

    def experts(self) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        """(weights, scales, offsets) per slot, as the fused MoE kernel takes them."""
        return self.data, self.scale, self.offset or []

    def select(self, index: Tensor) -> PanelStack:
        chosen = index.tolist()
        return PanelStack(self.bits, self.group_size, self.out_features, self.in_features,
                          [self.data[e] for e in chosen], [self.scale[e] for e in chosen],
                          None if self.offset is None else [self.offset[e] for e in chosen],
                          self.gate_up, self.form, self.dequant_from)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.data + self.scale + (self.offset or []))
