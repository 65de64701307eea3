"""The kernel plans of quantized weights (engine/kernels/plan.py): every form's panel plan picks
a valid way at every probe row count, both ways compute what the weight says at every row
count (int8 in w8a8's layout: int8 rows or a dequantized panel, exact), the plan's threshold
reads the plan as documented, and where a kernel is missing the plans fall back to what is
there."""

from __future__ import annotations

import pytest
import torch
from quant_reference import seen_rows, seen_weight

from evenflow.engine.kernels import native, panels, plan
from evenflow.engine.kernels.plan import (
    DENSE,
    NEVER_DEQUANT,
    PACKED,
    PANEL_PROBE_ROWS,
    ROWS_DEQUANT,
    ROWS_DIRECT,
    dequant_from,
)
from evenflow.engine.quant.panel_stack import PanelStack, usable
from evenflow.engine.quant.stacks import Int8Stack, QuantConfig, quantize

D, Q = ROWS_DIRECT, ROWS_DEQUANT
FORMS = {"int8": QuantConfig("int8"), "int4-g64": QuantConfig("int4", 64),
         "w8a8": QuantConfig("w8a8")}


def test_the_threshold_reads_the_plan():
    rows = PANEL_PROBE_ROWS
    assert dequant_from((Q,) * len(rows)) == 1
    assert dequant_from((D, D, Q, Q, Q, Q, Q, Q, Q)) == rows[1] + 1  # from 3 rows
    # an odd probe between: read directly up to the last probe that did
    assert dequant_from((D, Q, D, D, Q, D, Q, Q, Q)) == rows[5] + 1
    assert dequant_from((Q, Q, Q, Q, Q, Q, Q, Q, D)) == NEVER_DEQUANT
    assert dequant_from(()) == NEVER_DEQUANT
    assert panels.group_word(64, 17, NEVER_DEQUANT) == 64 | 17 << 32 | NEVER_DEQUANT << 48


def _values(form: str, n: int, k: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [quantize(torch.randn(n, k, generator=g) * 0.05, FORMS[form]) for _ in range(2)]


@pytest.mark.parametrize("form", list(FORMS))
def test_every_row_count_gets_a_valid_way_and_the_right_numbers(form):
    dtype = torch.bfloat16
    if native.panel_linear() is None or not usable(_values(form, 128, 256, 0), dtype):
        pytest.skip(f"{form} panels are not served here")
    values = _values(form, 128, 256, 1)
    stack = PanelStack.build(values, dtype=dtype)
    ways = stack.plan(dtype)
    assert len(ways) == len(PANEL_PROBE_ROWS) and set(ways) <= {D, Q}
    assert stack.dequant_from == dequant_from(ways)
    g = torch.Generator().manual_seed(2)
    # the measured plan, and each way forced at every row count (both must be right)
    for threshold in (stack.dequant_from, 1, NEVER_DEQUANT):
        forced = PanelStack(stack.bits, stack.group_size, 128, 256, stack.data, stack.scale,
                            stack.offset, False, stack.form, threshold)
        for rows in (1, 2, 3, 9, 16, 33, 100, 130):
            x = torch.randn(rows, 256, generator=g).to(dtype)
            want = seen_rows(forced, x) @ seen_weight(forced, values[1]).T
            got = forced.linear(x, 1).float()
            assert (got - want).abs().max() <= 2e-2 * want.abs().max(), (threshold, rows)


def test_int8_many_rows_on_a_dequantized_panel_are_weight_only_exact():
    """int8 in w8a8's layout, dequantized: the rows are not quantized (float32: exact)."""
    values = _values("int8", 128, 256, 3)
    if native.panel_linear() is None or not usable(values, torch.float32):
        pytest.skip("int8 panels are not served here")
    stack = PanelStack.build(values)
    stack.dequant_from = 1
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(4))
    want = x @ values[0].dequantize().T
    assert (stack.linear(x) - want).abs().max() <= 1e-4 * want.abs().max()


def test_without_native_kernels_the_plans_choose_among_torchs(monkeypatch):
    monkeypatch.setattr(native, "ops", lambda: None)
    plan.forget_choices()
    try:
        values = _values("int8", 96, 128, 5)
        stack = Int8Stack.build(values, torch.float32)
        assert set(stack.choice.plan) <= {PACKED, DENSE}
        for rows in (1, 7, 64, 70):
            x = torch.randn(rows, 128)
            want = x @ values[0].dequantize().T
            assert (stack.linear(x) - want).abs().max() <= 1e-4 * want.abs().max()
    finally:
        plan.forget_choices()
