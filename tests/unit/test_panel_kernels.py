"""The panel kernels compute what the weights say: the fused MoE kernel (every routed expert of
a layer in one call, engine/kernels/fused_moe.cpp) and the panel linear (panel_linear.cpp), over
plain fp32 / bf16 weights and int8 / int4 / 5-bit / MXFP4 / FP8 ones, for few rows (quantized
panels read directly) and many (dequantized first); the packing reorders without changing a
value; and the engine's greedy output is the same with them as with oneDNN's per-expert path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from quant_reference import seen_rows, seen_weight

from evenflow.engine.kernels import native, panels
from evenflow.engine.kernels.plan import NEVER_DEQUANT
from evenflow.engine.quant.fp8 import Fp8Values, expand_block_scales
from evenflow.engine.quant.mxfp4 import Mxfp4Values
from evenflow.engine.quant.panel_stack import PanelStack, usable
from evenflow.engine.quant.stacks import QuantConfig, QuantValues, quantize

DTYPES = [torch.float32, torch.bfloat16]
H, INTER, EXPERTS, TOP_K = 128, 192, 6, 2


@pytest.fixture(autouse=True)
def _kernels():
    if native.fused_moe() is None or native.panel_linear() is None:
        pytest.skip("native kernels unavailable")


def served(dtype: torch.dtype) -> None:
    if not panels.usable(dtype, H, 64):
        pytest.skip(f"the panel kernels do not take {dtype} on this CPU")


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
          requantized: bool = False) -> None:
    """`requantized`: the kernel quantized an activation it computed itself (the fused MoE's
    silu(gate) * up, W4A8's rows): one ulp there may flip one int8 rounding, a quantum of the
    group's peak / 127 (seen here: 4e-4 of the output's scale)."""
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3 if requantized else 1e-4
    assert (actual.float() - expected).abs().max().item() <= tol * expected.abs().max().item()


def moe_reference(x, ids, route, gate_up, down, rows=None):
    """Per token, per chosen expert: down(silu(gate) * up), weighted and summed, in float32.
    rows(r, e, which): a row as the quantized stacks' kernels see it (which: 0 gate_up, 1 down;
    e: the expert, whose row count decides)."""
    out = torch.zeros(x.shape[0], down[0].shape[0])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            xt = rows(x[t], e, 0) if rows is not None else x[t].float()
            gate, up = (xt @ gate_up[e].T).chunk(2)
            act = (F.silu(gate) * up).to(x.dtype)  # (the kernel keeps it in x's dtype)
            act = rows(act, e, 1) if rows is not None else act.float()
            out[t] += act @ down[e].T * route[t, j]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe_takes_biases_and_the_clamped_swiglu(dtype):
    """GPT-OSS's experts in the fused kernel: each slot's gate_up and down biases and the
    clamped SwiGLU in the epilogues, as model/moe.py computes them per expert."""
    from evenflow.engine.model.moe import clamped_swiglu

    served(dtype)
    g = torch.Generator().manual_seed(7)
    gate_up = [(torch.randn(2 * INTER, H, generator=g) * 0.3).to(dtype) for _ in range(EXPERTS)]
    down = [(torch.randn(H, INTER, generator=g) * 0.1).to(dtype) for _ in range(EXPERTS)]
    b13, b2 = torch.randn(EXPERTS, 2 * INTER, generator=g), torch.randn(EXPERTS, H, generator=g)
    w13 = [panels.pack_weight(w, gate_up=True) for w in gate_up]
    w2 = [panels.pack_weight(w) for w in down]
    alpha, limit = 1.702, 2.0  # (a low limit: the clamps are exercised)
    for tokens in (1, 6, 40):
        x = (torch.randn(tokens, H, generator=g) * 2).to(dtype)
        ids, route = routing(tokens, EXPERTS, g)
        expected = torch.zeros(tokens, H)
        for t in range(tokens):
            for j in range(TOP_K):
                e = int(ids[t, j])
                h = x[t].float() @ gate_up[e].float().T + b13[e]
                act = clamped_swiglu(h, alpha, limit).to(dtype).float()
                expected[t] += (act @ down[e].float().T + b2[e]) * route[t, j]
        got = panels.run_experts(x, ids, route, w13, w2, b13=b13, b2=b2,
                                 activation="clamped_swiglu", alpha=alpha, limit=limit)
        close(got, expected, dtype)


def routing(tokens: int, slots: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(slots, generator=g)[:TOP_K] for _ in range(tokens)])
    return ids, torch.rand(tokens, TOP_K, generator=g)


def test_packing_reorders_without_changing_a_value():
    w = torch.randn(2 * INTER, H, generator=torch.Generator().manual_seed(3))
    for dtype in DTYPES:
        for gate_up in (False, True):
            packed = panels.pack_weight(w.to(dtype), gate_up=gate_up)
            assert torch.equal(panels.unpack_weight(packed, gate_up=gate_up), w.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe_matches_the_per_expert_formula(dtype):
    served(dtype)
    g = torch.Generator().manual_seed(0)
    gate_up = [(torch.randn(2 * INTER, H, generator=g) * 0.1).to(dtype) for _ in range(EXPERTS)]
    down = [(torch.randn(H, INTER, generator=g) * 0.1).to(dtype) for _ in range(EXPERTS)]
    w13 = [panels.pack_weight(w, gate_up=True) for w in gate_up]
    w2 = [panels.pack_weight(w) for w in down]
    # 40 tokens: several row blocks per expert; 300: ~100 rows an expert (on AVX2 builds
    # these go through ATen's matmul over the panels: kernels/panel.h, kBlasRows)
    for tokens in (1, 5, 40, 300):
        x = torch.randn(tokens, H, generator=g).to(dtype)
        ids, route = routing(tokens, EXPERTS, g)
        expected = moe_reference(x, ids, route, [w.float() for w in gate_up],
                                 [w.float() for w in down])
        close(panels.run_experts(x, ids, route, w13, w2), expected, dtype)
    # slots of a placement are references: slot 6 is expert 0 again
    ids = torch.tensor([[6, 1], [0, 6]])
    x = torch.randn(2, H, generator=g).to(dtype)
    route = torch.rand(2, 2, generator=g)
    got = panels.run_experts(x, ids, route, w13 + w13[:1], w2 + w2[:1])
    close(got, moe_reference(x, ids % EXPERTS, route, [w.float() for w in gate_up],
                             [w.float() for w in down]), dtype)


def random_mxfp4(n: int, k: int, g: torch.Generator) -> Mxfp4Values:
    """Any bytes are valid MXFP4: random codes, exponents around 2^-5."""
    return Mxfp4Values(torch.randint(0, 256, (n, k // 32, 16), generator=g, dtype=torch.uint8),
                       torch.randint(119, 124, (n, k // 32), generator=g, dtype=torch.uint8))


def random_fp8(n: int, k: int, g: torch.Generator, tiles: bool = False) -> Fp8Values:
    """e4m3 values of either sign across its range, scales of 1e-4 a block of 128 inputs: one
    per (output channel, block), or per tile of 128 x 128 (`tiles`: as DeepSeek's checkpoints
    ship them)."""
    q = (torch.randn(n, k, generator=g) * 64).to(torch.float8_e4m3fn)
    if tiles:
        return Fp8Values(q, expand_block_scales(
            torch.rand(-(-n // 128), -(-k // 128), generator=g) * 2e-4, n))
    return Fp8Values(q, torch.rand(n, -(-k // 128), generator=g) * 2e-4)


def every_fp8_code(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """(n, k) e4m3 bytes drawn from all 254 of its values (zeros, subnormals, 448; no NaN)."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    return codes[torch.randint(0, len(codes), (n, k), generator=g)].view(torch.float8_e4m3fn)


def random_int5(n: int, k: int, g: torch.Generator) -> QuantValues:
    """5-bit codes in groups of 32 as GGUF's Q5 types hold them: w = (q - zero) * scale."""
    return QuantValues(5, torch.randint(0, 32, (n, k), generator=g, dtype=torch.uint8),
                       torch.rand(n, k // 32, generator=g) * 4e-3 + 1e-3,
                       torch.rand(n, k // 32, generator=g) * 31)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [QuantConfig("int8"), QuantConfig("int4", 64),
                                    QuantConfig("int4", 32, symmetric=True), "int5", "mxfp4",
                                    "fp8", "fp8-tiles"],
                         ids=["int8", "int4-g64", "int4-g32-sym", "int5", "mxfp4", "fp8",
                              "fp8-tiles"])
def test_quantized_panels_match_the_dequantized_weight(dtype, config):
    served(dtype)
    g = torch.Generator().manual_seed(1)
    if config == "mxfp4":
        values = [random_mxfp4(2 * INTER, H, g) for _ in range(EXPERTS)]
        downs = [random_mxfp4(H, INTER, g) for _ in range(EXPERTS)]
        if not usable(values, dtype, gate_up=True):
            pytest.skip("MXFP4 panels need AVX-512 VNNI (and EVENFLOW_NATIVE_W4A8 on)")
    elif config == "int5":
        values = [random_int5(2 * INTER, H, g) for _ in range(EXPERTS)]
        downs = [random_int5(H, INTER, g) for _ in range(EXPERTS)]
        if not usable(values, dtype, gate_up=True):
            pytest.skip("5-bit panels need AVX-512 VNNI (and EVENFLOW_NATIVE_W4A8 on)")
    elif config in ("fp8", "fp8-tiles"):  # (K = 192: a block of 128 and a partial one)
        tiles = config == "fp8-tiles"
        values = [random_fp8(2 * INTER, H, g, tiles) for _ in range(EXPERTS)]
        downs = [random_fp8(H, INTER, g, tiles) for _ in range(EXPERTS)]
    else:
        values = [quantize(torch.randn(2 * INTER, H, generator=g) * 0.05, config)
                  for _ in range(EXPERTS)]
        downs = [quantize(torch.randn(H, INTER, generator=g) * 0.05, config)
                 for _ in range(EXPERTS)]
    linear = PanelStack.build(values[:1])
    gate_up = PanelStack.build(values, gate_up=True)
    down = PanelStack.build(downs)
    # direct reads (few rows: 1 to 4 a register block; int4 on bf16 rows stays direct up to
    # 15) and dequantized panels (many)
    # (int4 where VNNI is: few rows meet it quantized per group, W4A8: quant_reference.py)
    for rows in (1, 3, 5, 11, 40):
        x = torch.randn(rows, H, generator=g).to(dtype)
        close(linear.linear(x), seen_rows(linear, x) @ seen_weight(linear, values[0]).T, dtype)
        close(gate_up.linear(x, 2), seen_rows(gate_up, x) @ seen_weight(gate_up, values[2]).T,
              dtype)  # plain order
        ids, route = routing(rows, EXPERTS, g)
        (w13, s13, o13), (w2, s2, o2) = gate_up.experts(), down.experts()
        got = panels.run_experts(x, ids, route, w13, w2, s13, s2, o13, o2, gate_up.group_size)
        per_expert = torch.bincount(ids.flatten(), minlength=EXPERTS)

        def seen(r, e, which, counts=per_expert):  # a row as expert e's kernel sees it
            many = r.expand(int(counts[e]), -1)  # (its row count decides)
            return seen_rows((gate_up, down)[which], many)[0]

        expected = moe_reference(x, ids, route, [seen_weight(gate_up, v) for v in values],
                                 [seen_weight(down, v) for v in downs], seen)
        close(got, expected, dtype, requantized=True)


@pytest.mark.parametrize("shared", [True, False], ids=["half-panel-scales", "channel-scales"])
def test_fp8_panels_on_bf16_rows_compute_every_code_exactly(shared):
    """bf16 rows meet FP8 values looked up as bf16 (panel_fp8.h): every e4m3 code, subnormals
    and both zeros included, gives what float32 arithmetic on the same numbers gives, up to
    the output's bf16 rounding. Few rows see the exact values times the float32 scale; many
    rows a bf16 panel of value * scale, rounded once (the table where a half panel shares its
    scale, per channel otherwise)."""
    served(torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    n, k = 256, 320  # (two blocks of 128 inputs and a partial one)
    # a scale per (32 channels, block) as 128 x 128 tiles give each half panel (a gate_up
    # panel's halves from two tiles), or one per (channel, block)
    scale = torch.rand(n // 32 if shared else n, -(-k // 128), generator=g) * 2e-4
    values = Fp8Values(every_fp8_code(n, k, g),
                       scale.repeat_interleave(32, dim=0) if shared else scale)
    exact = values.dequantize()
    # each way forced at every row count: read directly (1-6 rows a pass), or dequantized (a
    # pass alone: first, then read; more rows: while the first pass reads it)
    for threshold, weight in ((NEVER_DEQUANT, exact), (1, exact.bfloat16().float())):
        stack = PanelStack.build([values])
        stack.dequant_from = threshold
        for rows in (1, 3, 6, 7, 40):
            x = torch.randn(rows, k, generator=g).bfloat16()
            expected = x.float() @ weight.T
            got = stack.linear(x).float()
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, expected, rtol=8e-3,
                                       atol=1e-4 * expected.abs().max().item())


def test_a_placement_selects_quantized_slots_by_reference():
    g = torch.Generator().manual_seed(4)
    values = [quantize(torch.randn(128, H, generator=g) * 0.05, QuantConfig("int8"))
              for _ in range(4)]
    stack = PanelStack.build(values)
    slots = stack.select(torch.tensor([2, 0, 2]))
    assert slots.data[0] is stack.data[2] and slots.num == 3
    x = torch.randn(2, H, generator=g)
    assert torch.equal(slots.linear(x, 2), stack.linear(x, 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_panel_linear_matches_torch_and_pads_to_a_panel(dtype):
    served(dtype)
    g = torch.Generator().manual_seed(2)
    for out_features in (192, 8):  # 8: a MoE router, padded to one panel of 64
        layer = torch.nn.Linear(H, out_features, bias=True).to(dtype)
        fast = panels.PanelLinear(layer)
        for rows in (1, 7, 200):
            x = torch.randn(rows, H, generator=g).to(dtype)
            got = fast(x)
            assert got.shape == (rows, out_features)
            close(got, F.linear(x.float(), layer.weight.float(), layer.bias.float()), dtype)


def test_unusable_shapes_are_refused_not_miscomputed():
    x = torch.zeros(2, H)
    with pytest.raises(RuntimeError, match="panel layout"):
        torch.ops.evenflow_kernels.panel_linear(x, torch.zeros(64, H + 2, 64), None)
    with pytest.raises(RuntimeError, match="wrong size"):  # gate_up sized for another INTER
        panels.run_experts(x, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1),
                           [torch.zeros(2 * 64 * H)], [torch.zeros(H * INTER)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_greedy_output_is_the_same_as_the_per_expert_path(monkeypatch, dtype, quantization):
    from evenflow import LLM, SamplingParams

    served(getattr(torch, dtype))
    if quantization and not native.built_for_avx512():
        pytest.skip("the quantized panels are AVX-512's")
    prompts = ["count from 17 :", "count down from 90 :", "reverse : q w e r ="]
    params = SamplingParams(temperature=0, max_tokens=12)
    fused = LLM("tiny-moe", dtype=dtype, quantization=quantization)
    assert fused.engine.model.moe_layers()[0].experts_in_use().fused_args() is not None
    with_panels = [o.token_ids for o in fused.generate(prompts, params)]
    monkeypatch.setattr(native, "fused_moe", lambda: None)
    monkeypatch.setattr(native, "panel_linear", lambda: None)
    per_expert = LLM("tiny-moe", dtype=dtype, quantization=quantization)
    assert per_expert.engine.model.moe_layers()[0].experts_in_use().fused_args() is None
    assert [o.token_ids for o in per_expert.generate(prompts, params)] == with_panels


def test_values_round_trip_through_the_int4_nibbles():
    q = torch.randint(0, 16, (64, H), dtype=torch.uint8,
                      generator=torch.Generator().manual_seed(6))
    values = QuantValues(4, q, torch.ones(64, H // 32), torch.zeros(64, H // 32))
    stack = PanelStack.build([values])
    eye = torch.eye(H)
    assert torch.equal(stack.linear(eye).T, q.float())


@pytest.fixture
def amx_switch():
    """The kernels' process-wide AMX switch (a deterministic engine earlier in this process
    may have turned it off), put back as it was afterwards."""
    kernels = native.ops()
    if not hasattr(kernels, "amx_tiles"):
        pytest.skip("native kernels without the AMX switch")
    before = bool(kernels.amx_tiles())
    kernels.set_amx_tiles(True)
    if not kernels.amx_tiles():
        pytest.skip("no AMX tiles on this CPU")
    yield kernels.set_amx_tiles
    kernels.set_amx_tiles(before)


@pytest.mark.parametrize("rows", [2, 5, 16, 37])
def test_amx_tiles_agree_with_the_register_kernels(amx_switch, rows):
    """bf16 on AMX tiles (kernels/panel_amx.h), from one row for experts and two for linears,
    rows past a block's last dropped: the same sums as the register kernels to bf16's rounding,
    for the panel linear and the fused experts (with GPT-OSS's biases and clamped SwiGLU)."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, H, generator=g).bfloat16()
    w = (torch.randn(3 * 64, H, generator=g) / H**0.5).bfloat16()
    gate_up = [(torch.randn(2 * INTER, H, generator=g) / H**0.5).bfloat16() for _ in range(EXPERTS)]
    down = [(torch.randn(H, INTER, generator=g) / INTER**0.5).bfloat16() for _ in range(EXPERTS)]
    ids = torch.randint(0, EXPERTS, (rows, TOP_K), generator=g)
    route = torch.rand(rows, TOP_K, generator=g)
    b13, b2 = torch.randn(EXPERTS, 2 * INTER, generator=g), torch.randn(EXPERTS, H, generator=g)
    kernels = native.ops()
    packed = panels.pack_weight(w)
    w13 = [panels.pack_weight(t, gate_up=True) for t in gate_up]
    w2 = [panels.pack_weight(t) for t in down]

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        return (kernels.panel_linear(x, packed, None, None, None, 0),
                kernels.fused_moe(x, ids, route, w13, w2, [], [], [], [], 0, b13, b2, 1, 1.702,
                                  7.0))

    amx_switch(True)
    tiles = both()
    amx_switch(False)
    registers = both()
    for a, b in zip(tiles, registers, strict=True):
        close(a, b.float(), torch.bfloat16)
    close(tiles[0], x.float() @ w.float().T, torch.bfloat16)
