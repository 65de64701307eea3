"""`--model org/name`: a Hugging Face id resolves through huggingface_hub's cache, offline from a
populated cache (HF_HUB_OFFLINE=1), and is served under that id (or --served-model-name)."""

from __future__ import annotations

import shutil

import pytest

from evenflow import LLM, SamplingParams, models
from evenflow.services.config import MeshConfig

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A cache as huggingface_hub lays it out, holding tiny-moe as acme/tiny-moe-hub."""
    repo = tmp_path / "hub" / "models--acme--tiny-moe-hub"
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(models.BUILTIN_MODELS_DIR / "tiny-moe", snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return snapshot


def test_a_hub_id_loads_from_the_offline_cache(hub_cache):
    assert models.resolve_model("acme/tiny-moe-hub") == hub_cache
    assert models.resolve_model("acme/not-cached") is None  # offline: no download, no hang
    out = LLM("acme/tiny-moe-hub").generate(["count from 17 :"],
                                            SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.text == " 17 18 19 20"


def test_the_served_name_is_the_id_or_the_given_one(hub_cache):
    assert MeshConfig(model="acme/tiny-moe-hub").model_name == "acme/tiny-moe-hub"
    assert MeshConfig(model="acme/tiny-moe-hub", served_model_name="tiny").model_name == "tiny"
    assert MeshConfig(model="tiny-moe").model_name == "tiny-moe"
