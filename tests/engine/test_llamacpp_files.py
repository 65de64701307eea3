"""GGUF files written by llama.cpp's own llama-quantize (tests/data/llamacpp, how they were made
is in its README): they load as stored and tiny-moe's tasks stay within 3 points of bf16."""

from __future__ import annotations

from pathlib import Path

import pytest

from evenflow.bench.offline.quant_bench import task_accuracy

FILES = Path(__file__).resolve().parents[1] / "data" / "llamacpp"
PLAN = {"task_prompts": 40}  # each of count, count down, reverse, copy, edit


@pytest.fixture(scope="module")
def shipped_accuracy():
    """tiny-moe as it ships (bf16 weights; the CPU's native dtype computes)."""
    return task_accuracy(1, PLAN)


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q6_K"])
def test_llama_quantize_files_keep_tiny_moe_tasks_within_3_points(kind, shipped_accuracy):
    accuracy = task_accuracy(1, PLAN, model=str(FILES / f"tiny-moe-{kind}.gguf"))
    for task, points in shipped_accuracy.items():
        assert accuracy[task] >= points - 3, (kind, accuracy, shipped_accuracy)
