"""MoE routing in one native call gives what torch's softmax / topk / bincount give — the same
experts (ties in bf16 logits included), the same weights, the same EPLB counts — also when the
router's logits carry a panel's padding columns; DeepSeek-V2 / -V3 and GPT-OSS routing pick
what their transformers routers pick."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from evenflow.engine.kernels import native
from evenflow.engine.kernels.panels import PanelLinear
from evenflow.engine.model import routing as routing


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


def test_route_through_a_padded_panel_router_matches_the_plain_router():
    if native.route_topk() is None or native.panel_linear() is None:
        pytest.skip("native kernels unavailable")
    torch.manual_seed(0)
    gate = nn.Linear(128, 8, bias=False)
    x = torch.randn(6, 128)
    counts = torch.zeros(8, dtype=torch.long)
    weights, chosen = routing.route(PanelLinear(gate), x, routing.Routing(8, 2, True), counts,
                                    kernel=native.route_topk())
    torch_counts = torch.zeros(8, dtype=torch.long)  # (no kernel: torch's ops)
    want_w, want_e = routing.route(gate, x, routing.Routing(8, 2, True), torch_counts)
    assert torch.equal(chosen, want_e)
    torch.testing.assert_close(weights, want_w)  # (the panel linear sums in its own order)
    assert torch.equal(counts, torch_counts) and counts.sum() == 12


def _hf_router(kind: str, **config):
    """transformers' own router of a family, random weights (the oracle)."""
    import transformers

    cls, router = {"v3": ("DeepseekV3Config", "DeepseekV3TopkRouter"),
                   "v2": ("DeepseekV2Config", "DeepseekV2TopkRouter"),
                   "gpt_oss": ("GptOssConfig", "GptOssTopKRouter")}[kind]
    cfg = getattr(transformers, cls)(hidden_size=32, **config)
    module = getattr(transformers.models, {"v3": "deepseek_v3", "v2": "deepseek_v2",
                                           "gpt_oss": "gpt_oss"}[kind])
    modeling = getattr(module, f"modeling_{module.__name__.rsplit('.', 1)[1]}")
    torch.manual_seed(0)
    hf = getattr(modeling, router)(cfg)
    with torch.no_grad():
        hf.weight.normal_()
        for name in ("e_score_correction_bias", "bias"):
            if hasattr(hf, name):
                getattr(hf, name).normal_(0, 0.5)
    return hf


@pytest.mark.parametrize("kind, config, spec", [
    ("v3", dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                norm_topk_prob=True, routed_scaling_factor=2.5),
     routing.Routing(16, 4, True, "sigmoid", 4, 2, "top2_sum", 2.5)),
    ("v2", dict(n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2,
                topk_method="group_limited_greedy", routed_scaling_factor=1.5),
     routing.Routing(16, 3, False, "softmax", 4, 2, "max", 1.5)),
    ("gpt_oss", dict(num_local_experts=8, num_experts_per_tok=2),
     routing.Routing(8, 2, False, "softmax_topk")),
])
def test_family_routing_matches_transformers(kind, config, spec):
    """Group-limited choice, sigmoid scores with the correction bias, softmax over the top-k
    logits: the same experts and weights as each family's own router."""
    hf = _hf_router(kind, **config)
    x = torch.randn(64, 32)
    _, want_w, want_e = hf(x)
    gate = nn.Linear(32, spec.num_experts, bias=kind == "gpt_oss")
    with torch.no_grad():
        gate.weight.copy_(hf.weight)
        if kind == "gpt_oss":
            gate.bias.copy_(hf.bias)
    bias = hf.e_score_correction_bias if kind == "v3" else None
    counts = torch.zeros(spec.num_experts, dtype=torch.long)
    weights, experts = routing.route(gate, x, spec, counts, bias)
    order_w, order_e = want_e.sort(dim=-1)[1], experts.sort(dim=-1)[1]
    assert torch.equal(experts.gather(1, order_e), want_e.gather(1, order_w))
    torch.testing.assert_close(weights.gather(1, order_e), want_w.float().gather(1, order_w))
    assert counts.sum() == 64 * spec.top_k
