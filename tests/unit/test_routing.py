"""MoE routing in one native call gives what torch's softmax / topk / bincount give — the same
experts (ties in bf16 logits included), the same weights, the same EPLB counts — also when the
router's logits carry a panel's padding columns."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from evenflow.engine.kernels import native
from evenflow.engine.kernels.panels import PanelLinear
from evenflow.engine.model import router as routing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "experts", "top_k", "renormalize"),
                         [(1, 8, 2, True), (5, 8, 2, False), (37, 60, 4, True),
                          (300, 128, 8, False)])
def test_native_routing_matches_torch(dtype, tokens, experts, top_k, renormalize):
    kernel = native.route_topk()
    if kernel is None:
        pytest.skip("native kernels unavailable")
    g = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, -(-experts // 64) * 64, generator=g).to(dtype)
    counts = torch.zeros(experts, dtype=torch.long)
    weights, chosen = kernel(logits, experts, top_k, renormalize, counts)
    probs = torch.softmax(logits[:, :experts].float(), dim=-1)
    want_w, want_e = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        want_w = want_w / want_w.sum(dim=-1, keepdim=True)
    assert torch.equal(chosen, want_e) and torch.equal(weights, want_w)
    assert torch.equal(counts, torch.bincount(want_e.flatten(), minlength=experts))


def test_route_through_a_padded_panel_router_matches_the_plain_router(monkeypatch):
    if native.route_topk() is None or native.panel_linear() is None:
        pytest.skip("native kernels unavailable")
    torch.manual_seed(0)
    gate = nn.Linear(128, 8, bias=False)
    x = torch.randn(6, 128)
    counts = torch.zeros(8, dtype=torch.long)
    weights, chosen = routing.route(PanelLinear(gate), x, 8, 2, True, counts)
    monkeypatch.setattr(native, "route_topk", lambda: None)  # torch's ops instead
    torch_counts = torch.zeros(8, dtype=torch.long)
    want_w, want_e = routing.route(gate, x, 8, 2, True, torch_counts)
    assert torch.equal(chosen, want_e)
    torch.testing.assert_close(weights, want_w)  # (the panel linear sums in its own order)
    assert torch.equal(counts, torch_counts) and counts.sum() == 12
