"""The fast decode stack (engine/model/decode_stack.py: the layers, or the whole step, as one native
call) computes exactly what the module path computes: the same logits, bit for bit, at every
step, and the same expert counts for EPLB."""

from __future__ import annotations

import pytest
import torch

from evenflow import LLM, SamplingParams
from evenflow.engine.kernels import native, panels


def _recorded(llm: LLM, fast: bool) -> list[torch.Tensor]:
    """Every forward pass's logits, from now on (fast: False sends every step down the module
    path)."""
    model = llm.engine.runner.model
    if not fast:
        model._fast, model._fast_checked = None, True
    logits: list[torch.Tensor] = []
    forward = model.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        logits.append(out.clone())
        return out

    model.forward = recording
    return logits


def _run(dtype: str, quantization: str | None, fast: bool, **options
         ) -> tuple[list[torch.Tensor], list[list[int]], torch.Tensor, bool]:
    llm = LLM("tiny-moe", dtype=dtype, quantization=quantization, **options)
    model = llm.engine.runner.model
    logits = _recorded(llm, fast)
    prompts = ["count from 17 :", "count down from 90 :", "reverse : q w e r =", "json ="]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16))
    whole_step = model._fast is not None and model._fast.head is not None
    return logits, [o.token_ids for o in outputs], llm.engine.take_expert_counts(), whole_step


@pytest.mark.parametrize("dtype,quantization,kv_cache_dtype", [
    (dtype, quantization, "auto") for dtype in ("float32", "bfloat16")
    for quantization in (None, "int8", "int4")] + [("bfloat16", None, "int8")])
def test_fast_decode_is_bit_identical_to_the_module_path(dtype, quantization, kv_cache_dtype):
    if native.fused_moe() is None or native.decode_attention() is None or \
            not panels.usable(getattr(torch, dtype), 64, 64):
        pytest.skip("the native kernels do not serve this dtype here")
    if quantization and not native.built_for_avx512():
        pytest.skip("the quantized panels are AVX-512's")
    kv = {"kv_cache_dtype": kv_cache_dtype}
    fast_logits, fast_tokens, fast_counts, used = _run(dtype, quantization, fast=True, **kv)
    assert used, "the fast decode step (layers and head) was not built for tiny-moe"
    slow_logits, slow_tokens, slow_counts, _ = _run(dtype, quantization, fast=False, **kv)
    assert fast_tokens == slow_tokens
    assert len(fast_logits) == len(slow_logits)
    for a, b in zip(fast_logits, slow_logits, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(fast_counts, slow_counts)


def test_fast_decode_step_with_a_quantized_lm_head():
    if native.fused_moe() is None or not native.built_for_avx512():
        pytest.skip("the quantized panels are AVX-512's")
    fast_logits, fast_tokens, _, used = _run("float32", "int8", True, quantize_lm_head=True)
    assert used
    slow_logits, slow_tokens, _, _ = _run("float32", "int8", False, quantize_lm_head=True)
    assert fast_tokens == slow_tokens
    for a, b in zip(fast_logits, slow_logits, strict=True):
        assert torch.equal(a, b)


def _run_placed(fast: bool) -> tuple[list[torch.Tensor], list[list[int]], torch.Tensor, bool]:
    """tiny-moe under an expert placement with replicas (as the mesh's workers run), then under
    a new one with uneven replica shares halfway."""
    llm = LLM("tiny-moe", dtype="float32", num_ep_ranks=2, num_redundant_experts=4)
    engine, model = llm.engine, llm.engine.runner.model
    logits = _recorded(llm, fast)
    params = SamplingParams(temperature=0, max_tokens=12)
    tokens = [o.token_ids for o in llm.generate(["count from 17 :", "json ="], params)]
    layers, slots = engine.placement.slot_counts.shape
    phy2log = (torch.arange(slots) * 3 % 8).repeat(layers, 1)  # experts 0, 3, 6, 1, ... 8 x2+
    shares = torch.where(torch.arange(slots) < 8, 0.7, 0.3).repeat(layers, 1)
    engine.placement.apply_placement(phy2log, shares, version=1)
    tokens += [o.token_ids for o in llm.generate(["reverse : q w e r =", "count down from 90 :"],
                                                 params)]
    used = model._fast is not None and all(f.held[1] is not None for f in model._fast.layers)
    return logits, tokens, engine.placement.slot_counts.clone(), used


def test_fast_decode_under_an_expert_placement_is_bit_identical():
    if native.fused_moe() is None or native.decode_attention() is None or \
            not panels.usable(torch.float32, 64, 64) or not native.built_for_avx512():
        pytest.skip("the native kernels do not serve this here")
    fast_logits, fast_tokens, fast_slots, used = _run_placed(True)
    assert used, "the fast decode step was not rebuilt under the placement"
    slow_logits, slow_tokens, slow_slots, _ = _run_placed(False)
    assert fast_tokens == slow_tokens
    for a, b in zip(fast_logits, slow_logits, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(fast_slots, slow_slots) and int(fast_slots.sum()) > 0
