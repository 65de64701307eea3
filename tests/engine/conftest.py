"""Fixtures the speculative decoding tests share (test_speculative.py, test_model_drafts.py)."""

from __future__ import annotations

import pytest
from checkpoints import make_checkpoint

from evenflow.engine.serving.speculation import DraftCost


@pytest.fixture
def steady_row_cost(monkeypatch):
    """The draft length's cost side is fitted to measured step times, which a loaded machine
    makes noisy; tests about drafting and verifying give a row a fixed cost share instead."""
    monkeypatch.setattr(DraftCost, "row_cost", lambda self, batch: 0.1)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A random GPT-OSS checkpoint (a module's own where it defines one of this name)."""
    path = tmp_path_factory.mktemp("gpt_oss")
    make_checkpoint("gpt_oss", path)
    return path
