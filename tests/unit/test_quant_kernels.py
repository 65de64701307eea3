"""Quantized weights compute what their dequantized values say, in every stored form and
kernel (torch's packed int8/int4 kernels, our own C++ kernel and dequantize-then-matmul), in
fp32 and bf16; w8a8 computes the integer product of per-token int8 rows and int8 weights (VNNI
panels, fused experts, torch's _int_mm); the GPTQ and compressed-tensors layouts read back."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from evenflow.engine.kernels import native
from evenflow.engine.kernels.plan import DENSE, NATIVE, PACKED, KernelChoice
from evenflow.engine.quant.stacks import (
    Int4Stack,
    Int8Stack,
    QuantConfig,
    QuantValues,
    W8A8Stack,
    quantize,
    quantize_rows,
)
from evenflow.engine.weights import gptq

DTYPES = [torch.float32, torch.bfloat16]


def weights(experts: int = 3, n: int = 96, k: int = 128, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, k, generator=g) * 0.02 for _ in range(experts)]


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    # bf16: the weight rounded to bf16 (dequantize-then-matmul) and the output rounded: over
    # 128 inputs the error reaches ~2% of the largest output for some inputs
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    scale = expected.abs().max().item()
    assert (actual.float() - expected).abs().max().item() <= tol * scale


def test_native_kernels_build_where_a_compiler_is():
    # a build that breaks must fail here, not fall back to torch's kernels unnoticed
    if shutil.which("c++") is None or not native.enabled():
        pytest.skip("no C++ compiler (or EVENFLOW_NATIVE_KERNELS=0): torch's kernels serve")
    assert native.ops() is not None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", [PACKED, DENSE, NATIVE])
def test_int8_every_kernel_matches_the_dequantized_weight(dtype, kernel):
    if kernel == NATIVE and native.ops() is None:
        pytest.skip("native kernels unavailable")
    values = [quantize(w, QuantConfig("int8")) for w in weights()]
    stack = Int8Stack.build(values, dtype)
    stack = Int8Stack(stack.q, stack.scale, KernelChoice((kernel,)))
    g = torch.Generator().manual_seed(5)
    for m in (1, 5, 33):
        x = torch.randn(m, 128, generator=g)
        for e, v in enumerate(values):
            expected = F.linear(x.to(dtype).float(), v.dequantize())
            close(stack.linear(x.to(dtype), e), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ["packed", "plain", "native"])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_every_form_matches_the_dequantized_weight(dtype, form, symmetric, group):
    if form == "native" and native.ops() is None:
        pytest.skip("native kernels unavailable")
    values = [quantize(w, QuantConfig("int4", group, symmetric)) for w in weights()]
    scale = torch.stack([v.scale for v in values])
    zero = torch.stack([v.zero if v.zero is not None else torch.full_like(v.scale, 8.0)
                        for v in values])
    if form == "packed":
        stack = Int4Stack._packed(values, scale, -zero * scale, dtype)
    else:
        plan = KernelChoice((NATIVE if form == "native" else DENSE,))
        stack = Int4Stack._plain(values, scale, -zero * scale, dtype, plan)
        assert (stack.ops is not None) == (form == "native")
    g = torch.Generator().manual_seed(7)
    for m in (1, 7, 33):
        x = torch.randn(m, 128, generator=g)
        for e, v in enumerate(values):
            close(stack.linear(x.to(dtype), e), F.linear(x.to(dtype).float(), v.dequantize()),
                  dtype)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_select_builds_the_slot_stack_of_an_expert_placement(method):
    values = [quantize(w, QuantConfig(method)) for w in weights(experts=4)]
    from evenflow.engine.quant.forms import build_stack

    stack = build_stack(values, torch.float32)
    slots = stack.select(torch.tensor([2, 0, 2, 3, 1]))
    x = torch.randn(3, 128)
    assert slots.num == 5
    for slot, expert in enumerate([2, 0, 2, 3, 1]):
        assert torch.equal(slots.linear(x, slot), stack.linear(x, expert))


def test_quantization_error_is_what_the_method_promises():
    w = weights(experts=1, n=256, k=256)[0]
    err8 = (quantize(w, QuantConfig("int8")).dequantize() - w).abs()
    err4 = (quantize(w, QuantConfig("int4", 64)).dequantize() - w).abs()
    row_max = w.abs().amax(dim=1, keepdim=True)
    assert (err8 <= row_max / 127 / 2 + 1e-7).all()  # half a step of a per-row scale
    assert err4.mean() < 0.1 * w.abs().mean()
    assert err8.mean() < err4.mean()


def test_config_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="int3"):
        QuantConfig("int3")
    with pytest.raises(ValueError, match="group size"):
        QuantConfig("int4", group_size=48)
    assert not QuantConfig("int4", 64).fits((128, 96))  # K not a multiple of the group
    assert QuantConfig("int8").fits((128, 96))


def test_gptq_packs_the_lowest_k_in_the_lowest_bits():
    q = torch.zeros(16, 2, dtype=torch.int64)  # (K, N)
    q[0, 0], q[1, 0], q[7, 1], q[8, 1] = 1, 2, 15, 3
    packed = gptq._pack_rows(q, 4)  # (K / 8, N)
    assert packed.shape == (2, 2) and packed.dtype == torch.int32
    assert packed[0, 0].item() == 1 | (2 << 4)
    assert packed[0, 1].item() == -(1 << 28)  # 15 << 28 as a signed int32
    assert packed[1, 1].item() == 3
    assert torch.equal(gptq._unpack_rows(packed, 4), q.to(torch.int32))


@pytest.mark.parametrize(("method", "symmetric"), [("int4", False), ("int4", True),
                                                   ("int8", True)])
def test_gptq_tensors_read_back_to_the_same_values(method, symmetric):
    config = QuantConfig(method, 64, symmetric)
    w = weights(experts=1)[0]
    bits = 8 if method == "int8" else 4
    tensors = gptq._gptq_tensors("layer", w, config, bits)
    spec = {"bits": bits, "group_size": 64 if bits == 4 else -1, "sym": symmetric}
    got: QuantValues = gptq.to_values(tensors, "layer", spec)
    want = quantize(w, config)
    assert torch.equal(got.q, want.q)
    assert torch.allclose(got.dequantize(), want.dequantize(), rtol=1e-3, atol=1e-6)


def w8a8_reference(x: torch.Tensor, v: QuantValues) -> torch.Tensor:
    """x @ w.T as w8a8 defines it: x's rows quantized per token, integer sums, both scales."""
    q, row_scale = quantize_rows(x)
    return (q.double() @ v.q.double().T * row_scale.double() * v.scale[:, 0].double()).float()


def test_quantize_rows_is_symmetric_per_row_and_keeps_zero_rows():
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and q[0].tolist() == [64, -127, 32, 0]  # 63.5 -> 64 (even)
    assert scale[0].item() == pytest.approx(1 / 127) and scale[1].item() == 0
    assert q[1].abs().sum() == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a8_every_form_computes_the_integer_product(dtype):
    from evenflow.engine.quant.forms import build_stack

    values = [quantize(w, QuantConfig("w8a8")) for w in weights(n=128)]
    assert all(v.int8_activations and v.q.abs().max() <= 127 for v in values)
    stacks = [W8A8Stack.build(values), build_stack(values, dtype)]  # torch's, and the panels'
    g = torch.Generator().manual_seed(11)
    for m in (1, 5, 7, 33):
        x = torch.randn(m, 128, generator=g).to(dtype)
        for e, v in enumerate(values):
            want = w8a8_reference(x, v)
            for stack in stacks:  # exact integer sums: only the output's rounding differs
                tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
                assert (stack.linear(x, e).float() - want).abs().max() <= \
                    tol * want.abs().max(), type(stack).__name__
            # and close to the unquantized product (per-token int8 activations: ~1%)
            exact = F.linear(x.float(), v.dequantize())
            assert (want - exact).abs().max() <= 0.05 * exact.abs().max()


def test_w8a8_fused_experts_equal_each_expert_alone():
    from evenflow.engine.kernels import panels
    from evenflow.engine.quant.panel_stack import PanelStack, usable

    hidden, inter = 128, 64
    w13 = [quantize(w, QuantConfig("w8a8")) for w in weights(4, 2 * inter, hidden, seed=1)]
    w2 = [quantize(w, QuantConfig("w8a8")) for w in weights(4, hidden, inter, seed=2)]
    if not usable(w13, torch.bfloat16, gate_up=True):
        pytest.skip("no VNNI panel kernels here (torch's integer matmul serves w8a8)")
    gate_up, down = PanelStack.build(w13, gate_up=True), PanelStack.build(w2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, hidden, generator=g).bfloat16()
    slots = torch.tensor([[0, 2], [1, 3], [2, 2], [3, 0], [1, 0], [0, 1]])
    route = torch.rand(6, 2, generator=g)
    (a, s13, c13), (b, s2, c2) = gate_up.experts(), down.experts()
    got = panels.run_experts(x, slots, route, a, b, s13, s2, c13, c2, 0)
    want = torch.zeros(6, hidden)
    for t in range(6):
        for j in range(2):
            e = int(slots[t, j])
            h = gate_up.linear(x[t:t + 1], e).float()
            act = (F.silu(h[:, :inter]) * h[:, inter:]).bfloat16()
            want[t] += route[t, j] * down.linear(act, e).float()[0]
    assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()


def test_compressed_tensors_layers_read_back_to_the_same_values():
    from evenflow.engine.weights import compressed_tensors

    for method in ("w8a8", "int8"):
        spec = compressed_tensors.read_quant_config(
            compressed_tensors.quantization_config(method))
        assert spec["method"] == method
        want = quantize(weights(experts=1)[0], QuantConfig("w8a8"))
        tensors = {"a.weight": want.q, "a.weight_scale": want.scale, "b.weight": want.q.float()}
        got = compressed_tensors.take_quantized(tensors, spec)
        assert list(tensors) == ["b.weight"]  # an unquantized layer stays as it is
        assert torch.equal(got["a"].q, want.q) and torch.equal(got["a"].scale, want.scale)
        assert got["a"].int8_activations == (method == "w8a8")
