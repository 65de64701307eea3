"""The built-in default model does what README.md and docs/models.md say, through the API and
the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest
from checkpoints import assert_counts_and_reverses

from evenflow import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-moe")


def test_counts_and_reverses(llm):
    assert_counts_and_reverses(llm)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    chat = llm.chat([{"role": "user", "content": "count from 5"}], greedy)
    assert chat.text.split()[:4] == ["5", "6", "7", "8"]


def test_routing_is_skewed(llm):
    llm.engine.take_expert_counts()
    llm.generate(["count from 100 :", "reverse : a b c ="], SamplingParams(max_tokens=16))
    counts = llm.engine.take_expert_counts().float()  # (layers, experts)
    balancedness = (counts.mean(dim=1) / counts.max(dim=1).values).mean()
    assert balancedness < 0.8  # a trained MoE's routing is far from uniform


def test_cli_generate():
    proc = subprocess.run(
        [sys.executable, "-m", "evenflow.cli", "generate", "count from 30 :", "--max-tokens", "5"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:3] == ["30", "31", "32"]
    bad = subprocess.run(
        [sys.executable, "-m", "evenflow.cli", "generate", "hi", "--top-p", "0"],
        capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "top_p" in bad.stderr
