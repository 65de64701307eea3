"""Every native kernel against the torch path the engine runs without it, in one table (as
llama.cpp's test-backend-ops checks each backend's ops against the CPU's): each row names an op
of kernels/*.cpp, the shapes it serves (its output must match torch's within the row's
tolerance, or bit for bit where the kernel promises it) and shapes it does not serve (the
engine's dispatch must then pick torch's path, never call the kernel). A new op in the C++
must get a row here, or a line in ELSEWHERE naming the test that covers it."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from evenflow.engine.config.settings import ModelConfig
from evenflow.engine.kernels import native, panels
from evenflow.engine.model.attention import (
    Attention,
    AttentionKernels,
    gathered_decode_attention,
    windowed_attention,
)
from evenflow.engine.model.attention import paged_decode_attention as paged_decode_attention_picked
from evenflow.engine.model.kv_quant import gather_dequantized, write_quantized_torch

KERNELS = Path(__file__).resolve().parents[2] / "evenflow" / "engine" / "kernels"
G = torch.Generator().manual_seed(0)
# Covered by a test of their own (a packed weight layout or a whole layer to set up)
ELSEWHERE = {
    "int4_mm": "tests/unit/test_panel_kernels.py", "mla_decode": "tests/unit/test_mla_decode.py",
    "mla_decode_int8": "tests/unit/test_mla_decode.py",
    "decode_stack": "tests/engine/test_decode_fast.py",
    "decode_step": "tests/engine/test_decode_fast.py",
}
# Not kernels: what the build can do, and the AMX switch
QUERIES = {"set_amx_tiles", "amx_tiles", "fused_moe_bf16_supported", "w8a8_supported",
           "panel_kernels_fast", "panel_kernels_f32_fast", "paged_attention_registers"}


def rand(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=G) * scale).to(dtype)


@dataclass(frozen=True)
class Row:
    op: str
    shapes: list[dict]  # each: the case's sizes
    run: Callable[[dict, torch.dtype], tuple[torch.Tensor, torch.Tensor]]  # native, torch
    tolerance: dict[torch.dtype, float]  # 0: bit for bit
    refused: list[dict] = ()  # type: ignore[assignment]  # shapes the engine must not send it
    served: Callable[[dict, torch.dtype], bool] = lambda case, dtype: True


def tiny_config(case: dict) -> ModelConfig:
    """A one-layer model config with this case's attention heads."""
    return ModelConfig(architecture="test", vocab_size=32, hidden_size=64, num_layers=1,
                       num_heads=case["heads"], num_kv_heads=case["kv_heads"],
                       head_dim=case["hd"], intermediate_size=64, max_position_embeddings=64,
                       rms_norm_eps=1e-5, rope_theta=1e4, sparse_layers=(False,))


def ops() -> object:
    kernels = native.ops()
    if kernels is None:
        pytest.skip("native kernels unavailable")
    return kernels


# -- the rows' cases ---------------------------------------------------------------------------
def rms_norm(case: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x, w = rand(case["rows"], case["width"], dtype=dtype), rand(case["width"], dtype=dtype)
    return ops().rms_norm(x, w, 1e-5), F.rms_norm(x, (case["width"],), w, 1e-5)


def add_rms_norm(case: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x, r = (rand(case["rows"], case["width"], dtype=dtype) for _ in range(2))
    w = rand(case["width"], dtype=dtype)
    total, normed = ops().add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(total, x + r)
    return normed, F.rms_norm(x + r, (case["width"],), w, 1e-5)


def rotary_kv_write(case: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    T, nh, n_kv, hd = 5, case["heads"], case["kv_heads"], case["hd"]
    qkv = rand(T, nh + 2 * n_kv, hd, dtype=dtype, scale=3)
    cos, sin = rand(T, 1, hd, dtype=dtype), rand(T, 1, hd, dtype=dtype)
    caches = [torch.zeros(40, n_kv, hd, dtype=dtype) for _ in range(4)]
    slots = torch.tensor([3, 9, 10, 31, 0])
    q = ops().rotary_kv_write(qkv, cos, sin, caches[0], caches[1], slots, nh, n_kv)
    qk = qkv[:, : nh + n_kv]  # engine/model/attention.py's torch path
    qk = qk * cos + torch.roll(qk, hd // 2, -1) * sin
    caches[2].index_copy_(0, slots, qk[:, nh:])
    caches[3].index_copy_(0, slots, qkv[:, nh + n_kv:])
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    return q, qk[:, :nh]


def _decode_inputs(case: dict, dtype: torch.dtype) -> tuple:
    B, L, S, nh, n_kv, hd = 4, 40, 300, case["heads"], case["kv_heads"], case["hd"]
    q = rand(B, nh, hd, dtype=dtype, scale=2)
    k_cache, v_cache = rand(S, n_kv, hd, dtype=dtype), rand(S, n_kv, hd, dtype=dtype)
    slots = torch.stack([torch.randperm(S, generator=G)[:L] for _ in range(B)])
    lens = torch.tensor([1, L, 23, 9])
    return q, k_cache, v_cache, slots, lens


def _visible(slots: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    return torch.arange(slots.shape[1]).unsqueeze(0) < lens.unsqueeze(1)


def paged_decode_attention(case: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    q, k_cache, v_cache, slots, lens = _decode_inputs(case, dtype)
    hd, sinks = case["hd"], rand(case["heads"]) if case.get("sinks") else None
    got = ops().paged_decode_attention(q, k_cache, v_cache, slots, lens, hd**-0.5, sinks)
    visible = _visible(slots, lens)
    kd = k_cache[slots].transpose(1, 2).float()
    vd = v_cache[slots].transpose(1, 2).float()
    want = windowed_attention(q.float().unsqueeze(2), kd, vd, (lens - 1).unsqueeze(1),
                              torch.arange(slots.shape[1]).expand_as(slots), visible, 0, sinks,
                              hd**-0.5)[:, :, 0]
    return got, want


def paged_decode_attention_int8(case: dict, dtype: torch.dtype
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    q, k_src, v_src, slots, lens = _decode_inputs(case, dtype)
    block, blocks = 16, 18
    caches = []
    for src in (k_src, v_src):  # an int8 cache of 18 blocks written by the torch rule
        cache = torch.zeros(blocks * block + 1, case["kv_heads"], case["hd"], dtype=torch.int8)
        scales = torch.zeros(blocks + 1, case["kv_heads"])
        write_quantized_torch(src[: blocks * block], cache, scales,
                              torch.arange(blocks * block), block)
        caches += [cache, scales]
    slots = slots % (blocks * block)
    got = ops().paged_decode_attention_int8(q, caches[0], caches[2], caches[1], caches[3],
                                            slots, lens, case["hd"] ** -0.5, block)
    mask = torch.zeros(slots.shape, dtype=torch.float32).masked_fill_(
        ~_visible(slots, lens), float("-inf")).view(4, 1, 1, -1)
    want = gathered_decode_attention(q.float(), caches[0], caches[2], slots, mask,
                                     caches[1], caches[3])
    return got, want


def prefill_attention(case: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    T, ctx, nh, n_kv, hd = 24, 40, case["heads"], case["kv_heads"], case["hd"]
    q = rand(T, nh, hd, dtype=dtype)
    k_cache, v_cache = rand(100, n_kv, hd, dtype=dtype), rand(100, n_kv, hd, dtype=dtype)
    slots = torch.randperm(100, generator=G)[:ctx]
    window, sinks = case.get("window", 0), rand(nh) if case.get("sinks") else None
    got = ops().prefill_attention(q, k_cache, v_cache, slots, hd**-0.5, window, sinks)
    q_pos = torch.arange(ctx - T, ctx).unsqueeze(0)
    want = windowed_attention(q.float().transpose(0, 1)[None],
                              k_cache[slots].float().transpose(0, 1)[None],
                              v_cache[slots].float().transpose(0, 1)[None], q_pos,
                              torch.arange(ctx).unsqueeze(0), None, window, sinks, hd**-0.5)
    return got, want[0].transpose(0, 1)


def kv_write_int8(case: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    block, n_kv, hd = 16, case["kv_heads"], case["hd"]
    x = rand(case["tokens"], n_kv, hd, dtype=dtype, scale=2)
    slots = torch.arange(5, 5 + case["tokens"])  # runs across block boundaries
    got = [torch.zeros(8 * block + 1, n_kv, hd, dtype=torch.int8), torch.zeros(9, n_kv)]
    want = [t.clone() for t in got]
    ops().kv_write_int8(x, got[0], got[1], slots, block)
    write_quantized_torch(x, want[0], want[1], slots, block)
    assert torch.equal(got[1], want[1])  # the same scales
    return (gather_dequantized(got[0], got[1], slots, torch.float32),
            gather_dequantized(want[0], want[1], slots, torch.float32))


def route_topk(case: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    logits = rand(case["tokens"], case["experts"], dtype=dtype, scale=2)
    counts = torch.zeros(case["experts"], dtype=torch.int64)
    weights, ids = ops().route_topk(logits, case["experts"], case["k"], True, counts)
    top, want_ids = torch.topk(F.softmax(logits.float(), -1), case["k"], dim=-1)
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
    assert int(counts.sum()) == case["tokens"] * case["k"]
    # (the same pairs, in expert order: the kernel may list a tie's experts the other way)
    return weights.gather(1, ids.argsort(-1)), (top / top.sum(-1, keepdim=True)).gather(
        1, want_ids.argsort(-1))


def int8_mm(case: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x = rand(case["rows"], case["k"], dtype=dtype)
    q = torch.randint(-127, 128, (case["n"], case["k"]), generator=G, dtype=torch.int8)
    scale = torch.rand(case["n"], generator=G) / 100
    return ops().int8_mm(x, q, scale), x.float() @ (q.float() * scale[:, None]).T


def kv_blocks(case: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    layers, block, n_kv, hd = 3, 16, case["kv_heads"], case["hd"]
    caches = [rand(10 * block + 1, n_kv, hd, dtype=dtype) for _ in range(2 * layers)]
    ids = torch.tensor([7, 2, 3])
    got = ops().kv_blocks_read(caches, ids, block)
    want = torch.stack([torch.stack([c[: 10 * block].view(10, block, n_kv, hd)[ids]
                                     for c in caches[2 * i: 2 * i + 2]], dim=1)
                        for i in range(layers)], dim=1)
    copies = [torch.zeros_like(c) for c in caches]
    ops().kv_blocks_write(copies, ids, want.contiguous(), block)
    for c, copy in zip(caches, copies, strict=True):
        view, back = c[: 10 * block].view(10, block, n_kv, hd), copy[: 10 * block].view(
            10, block, n_kv, hd)
        assert torch.equal(view[ids], back[ids])
    return got, want


def panel_linear(case: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    layer = torch.nn.Linear(case["k"], case["n"], bias=True).to(dtype)
    x = rand(case["rows"], case["k"], dtype=dtype)
    return panels.PanelLinear(layer)(x), F.linear(x.float(), layer.weight.float(),
                                                  layer.bias.float())


def fused_moe(case: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    E, k, H, inter, T = case["experts"], case["k"], case["hidden"], case["inter"], case["tokens"]
    gate_up = [rand(2 * inter, H, dtype=dtype, scale=0.1) for _ in range(E)]
    down = [rand(H, inter, dtype=dtype, scale=0.1) for _ in range(E)]
    x = rand(T, H, dtype=dtype)
    ids = torch.stack([torch.randperm(E, generator=G)[:k] for _ in range(T)])
    route = torch.rand(T, k, generator=G)
    got = panels.run_experts(x, ids, route, [panels.pack_weight(w, gate_up=True)
                                             for w in gate_up],
                             [panels.pack_weight(w) for w in down])
    want = torch.zeros(T, H)  # per token, per chosen expert: down(silu(gate) * up), weighted
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            gate, up = (x[t].float() @ gate_up[e].float().T).chunk(2)
            act = (F.silu(gate) * up).to(dtype).float()  # (the kernel keeps it in x's dtype)
            want[t] += act @ down[e].float().T * route[t, j]
    return got, want


GQA = [dict(heads=8, kv_heads=2, hd=64), dict(heads=4, kv_heads=4, hd=32),
       dict(heads=16, kv_heads=2, hd=128), dict(heads=8, kv_heads=2, hd=64, sinks=True)]
TABLE = [
    Row("rms_norm", [dict(rows=7, width=520), dict(rows=1, width=64)], rms_norm,
        {torch.float32: 1e-5, torch.bfloat16: 0}),
    Row("add_rms_norm", [dict(rows=7, width=520), dict(rows=3, width=2048)], add_rms_norm,
        {torch.float32: 1e-5, torch.bfloat16: 0}),
    Row("rotary_kv_write", [dict(heads=8, kv_heads=2, hd=h) for h in (64, 128, 48)],
        rotary_kv_write, {torch.float32: 0, torch.bfloat16: 0}),
    Row("paged_decode_attention", GQA, paged_decode_attention,
        {torch.float32: 1e-4, torch.bfloat16: 2e-2},
        refused=[dict(heads=8, kv_heads=2, hd=40)],
        served=lambda case, dtype: native.decode_attention_serves(case["hd"])),
    Row("paged_decode_attention_int8", GQA[:3], paged_decode_attention_int8,
        {torch.float32: 1e-4, torch.bfloat16: 2e-2}),
    Row("prefill_attention", [dict(heads=8, kv_heads=2, hd=64),
                              dict(heads=8, kv_heads=2, hd=64, window=16, sinks=True),
                              dict(heads=16, kv_heads=2, hd=128)], prefill_attention,
        {torch.float32: 1e-4, torch.bfloat16: 3e-2},
        refused=[dict(heads=4, kv_heads=2, hd=32), dict(heads=8, kv_heads=2, hd=40)],
        served=lambda case, dtype: native.prefill_attention_serves(
            dtype, case["hd"], case["heads"] // case["kv_heads"])),
    Row("kv_write_int8", [dict(tokens=30, kv_heads=2, hd=64), dict(tokens=1, kv_heads=4, hd=32)],
        kv_write_int8, {torch.float32: 1e-6, torch.bfloat16: 1e-6}),
    Row("route_topk", [dict(tokens=9, experts=8, k=2), dict(tokens=3, experts=64, k=6)],
        route_topk, {torch.float32: 1e-5, torch.bfloat16: 1e-5}),
    Row("int8_mm", [dict(rows=1, k=256, n=96), dict(rows=5, k=512, n=64)], int8_mm,
        {torch.float32: 1e-3, torch.bfloat16: 3e-2}),
    Row("panel_linear", [dict(rows=r, k=128, n=n) for r, n in ((1, 192), (7, 8), (200, 192))],
        panel_linear, {torch.float32: 1e-4, torch.bfloat16: 3e-2},
        served=lambda case, dtype: panels.usable(dtype, case["k"], 64)),
    Row("fused_moe", [dict(tokens=t, experts=6, k=2, hidden=128, inter=192) for t in (1, 40)],
        fused_moe, {torch.float32: 1e-3, torch.bfloat16: 3e-2},
        served=lambda case, dtype: panels.usable(dtype, case["hidden"], 64)),
    Row("kv_blocks_read", [dict(kv_heads=2, hd=64), dict(kv_heads=1, hd=576)], kv_blocks,
        {torch.float32: 0, torch.bfloat16: 0}),
]
COVERED = {row.op for row in TABLE} | {"kv_blocks_write"}  # (written back in kv_blocks)
CASES = [(row, case, dtype) for row in TABLE for case in row.shapes
         for dtype in row.tolerance]


@pytest.mark.parametrize("row, case, dtype", CASES,
                         ids=[f"{r.op}-{'-'.join(f'{k}{v}' for k, v in c.items())}-"
                              f"{str(d)[6:]}" for r, c, d in CASES])
def test_the_kernel_matches_torch(row: Row, case: dict, dtype: torch.dtype) -> None:
    if row.op == "int8_mm" and dtype == torch.bfloat16:
        pytest.skip("int8 weights take float32 rows (engine/quant/stacks.py casts)")
    if not row.served(case, dtype):  # (an AVX2 build keeps torch's prefill attention)
        pytest.skip(f"this build's {row.op} does not serve {case} in {dtype}")
    got, want = row.run(case, dtype)
    tolerance = row.tolerance[dtype]
    if tolerance == 0:
        assert torch.equal(got, want.to(got.dtype))
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("row, case", [(r, c) for r in TABLE for c in r.refused],
                         ids=[f"{r.op}-{c}" for r in TABLE for c in r.refused])
def test_shapes_a_kernel_does_not_serve_go_to_torch(row: Row, case: dict) -> None:
    """The dispatch asks first: such a shape never reaches the kernel, and the engine's choice
    for such an attention layer is torch's."""
    ops()
    assert not row.served(case, torch.bfloat16) and not row.served(case, torch.float32)
    if row.op == "prefill_attention":
        layer = Attention(tiny_config(case))
        assert AttentionKernels.choose(layer, torch.float32, torch.float32).prefill is None
    if row.op == "paged_decode_attention":
        assert not paged_decode_attention_picked(1, case["hd"], case["heads"] // case["kv_heads"])


def test_every_op_of_the_cpp_has_a_row() -> None:
    defined = set()
    for source in KERNELS.glob("*.cpp"):
        defined |= set(re.findall(r'm\.def\("(\w+)', source.read_text()))
    missing = defined - COVERED - ELSEWHERE.keys() - QUERIES
    assert not missing, f"kernels without a row in this table: {sorted(missing)}"
    root = KERNELS.parents[2]
    assert all((root / path).is_file() for path in ELSEWHERE.values())
