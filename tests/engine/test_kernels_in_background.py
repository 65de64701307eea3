"""A machine's first start: the engine serves on torch's kernels while the native ones build in
another process (EVENFLOW_NATIVE_BUILD=background), then, once the build is done and it is
idle, reloads its weights onto them over the same KV cache: the same greedy tokens, and the
prefix cached before the switch still hits after it."""

from __future__ import annotations

import pytest
from checkpoints import generate_one, make_checkpoint

from evenflow import SamplingParams
from evenflow.engine.kernels import native
from evenflow.engine.serving.engine import Engine, EngineConfig

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = list(range(3, 43))  # 40 tokens: 10 blocks of 4


def generate(e: Engine, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    return generate_one(e, rid, prompt, GREEDY)


@pytest.fixture
def build_in_background(monkeypatch):
    """The native kernels "building elsewhere" until the test says they are done: returns a
    one-element list to set True."""
    if native.ops() is None:
        pytest.skip("the native kernels cannot be built here")
    done = [False]
    monkeypatch.setenv("EVENFLOW_NATIVE_BUILD", "background")
    monkeypatch.setattr(native, "is_built", lambda: done[0])
    native.refresh()
    yield done
    monkeypatch.undo()
    native.refresh()  # (the next test sees this process's kernels as they really are)


def test_an_idle_engine_switches_to_the_native_kernels_once_they_are_built(
        tmp_path, build_in_background):
    make_checkpoint("qwen3_moe", tmp_path / "ckpt")
    e = Engine(EngineConfig(model=str(tmp_path / "ckpt"), dtype="float32", block_size=4,
                            num_kv_blocks=64))
    assert native.pending()
    assert "torch kernels only" in e.kernels.summary()
    assert e.kernels.switch_when_ready() is None  # not built yet: torch's kernels serve
    on_torch, _ = generate(e, "a", PROMPT)

    build_in_background[0] = True
    e.add_request("busy", [5, 6, 7], GREEDY)
    assert e.kernels.switch_when_ready() is None  # never under a running request
    while e.has_unfinished():
        e.step()
    summary = e.kernels.switch_when_ready()
    assert summary is not None and "native kernels" in summary and "moe" in summary
    assert not native.pending()
    assert e.kernels.switch_when_ready() is None  # once

    on_native, cached = generate(e, "b", PROMPT)
    assert cached == 36  # the blocks computed before the switch serve after it
    assert on_native == on_torch
    fresh, cached = generate(e, "c", [9, *PROMPT])
    assert cached == 0 and len(fresh) == 8


def test_a_failed_background_build_leaves_torch_serving_and_says_so(
        tmp_path, build_in_background, monkeypatch):
    """The launcher's build gave up (no compiler, say): the engine stops waiting for it and
    its summary no longer says the kernels are coming."""
    make_checkpoint("qwen3_moe", tmp_path / "ckpt")
    e = Engine(EngineConfig(model=str(tmp_path / "ckpt"), dtype="float32", block_size=4,
                            num_kv_blocks=16))
    assert "until the native ones are built" in e.kernels.summary()
    monkeypatch.setattr(native, "build_failed", lambda: True)
    native.refresh()
    assert not native.pending() and e.kernels.switch_when_ready() is None
    assert "the native kernels could not be built" in e.kernels.summary()
