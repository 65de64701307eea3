"""`--model org/name`: a Hugging Face id resolves through huggingface_hub's cache, offline from a
populated cache (HF_HUB_OFFLINE=1), and is served under that id (or --served-model-name); one
that cannot be had is a HubError saying why (offline, no network, gated, no such repository or
revision, a malformed id), said by `evenflow up` in one line with exit status 2."""

from __future__ import annotations

import importlib
import shutil
import socket

import huggingface_hub
import pytest
from huggingface_hub import errors

from evenflow import LLM, SamplingParams, cli, models
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
    with pytest.raises(models.HubError, match="not in the local Hugging Face cache"):
        models.resolve_model("acme/not-cached")  # offline: no download, no hang
    out = LLM("acme/tiny-moe-hub").generate(["count from 17 :"],
                                            SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.text == " 17 18 19 20"


def test_the_served_name_is_the_id_or_the_given_one(hub_cache):
    assert MeshConfig(model="acme/tiny-moe-hub").model_name == "acme/tiny-moe-hub"
    assert MeshConfig(model="acme/tiny-moe-hub", served_model_name="tiny").model_name == "tiny"
    assert MeshConfig(model="tiny-moe").model_name == "tiny-moe"


# -- an id that cannot be had says why -------------------------------------------------------
ID = "acme/some-model"
LOCAL_DIR = f"`hf download {ID} --local-dir DIR`"  # the way round: serve a directory


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """An empty huggingface_hub cache (nothing cached, nothing downloaded into ~)."""
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return tmp_path / "hf" / "hub"


def _http_error(cls: type[Exception], status: int, message: str) -> Exception:
    """One of huggingface_hub's HTTP errors as it raises them: with the Hub's response (an
    httpx2 one, or httpx's before huggingface_hub moved to httpx2)."""
    http = importlib.import_module(
        "httpx2" if "httpx2" in str(errors.HfHubHTTPError.__mro__) else "httpx")
    response = http.Response(status, request=http.Request("GET", f"https://hf.co/{ID}"))
    return cls(message, response=response)


def _failing_download(monkeypatch, exc: BaseException) -> None:
    def snapshot_download(*_args, **_kwargs):
        raise exc

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)


def test_offline_and_not_cached(empty_cache, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(models.HubError) as caught:
        models.resolve_model(ID)
    message = str(caught.value)
    assert "not in the local Hugging Face cache" in message and "HF_HUB_OFFLINE" in message
    assert str(empty_cache) in message and LOCAL_DIR in message and "\n" not in message


def test_no_network_to_the_hub(empty_cache, monkeypatch):
    """A Hub endpoint that refuses connections (a closed local port), as with no network."""
    import huggingface_hub.constants as constants

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(models.HubError) as caught:
        models.resolve_model(ID)
    message = str(caught.value)
    assert "cannot reach the Hugging Face Hub" in message and "ConnectError" in message
    assert LOCAL_DIR in message and "\n" not in message


@pytest.mark.parametrize("make, expected", [
    (lambda: _http_error(errors.GatedRepoError, 403, "Access to model is restricted."),
     ["is gated", f"https://huggingface.co/{ID}", "hf auth login", "HF_TOKEN", LOCAL_DIR]),
    (lambda: _http_error(errors.RepositoryNotFoundError, 404, "Repository Not Found"),
     ["is not a directory", "has no repository", "hf auth login"]),
    (lambda: _http_error(errors.HfHubHTTPError, 401, "Invalid credentials"),
     ["has no repository", "if it is private", "HF_TOKEN"]),
    (lambda: _http_error(errors.RevisionNotFoundError, 404, "Revision Not Found"),
     ["has no revision 'main'", LOCAL_DIR]),
    (lambda: _not_cached_after(_http_error(errors.HfHubHTTPError, 503, "Service Unavailable")),
     ["the Hugging Face Hub failed to serve", "retry later", LOCAL_DIR]),
    (lambda: OSError(28, "No space left on device"),
     ["could not fetch", "No space left on device", LOCAL_DIR]),
])
def test_each_hub_failure_says_why(empty_cache, monkeypatch, make, expected):
    _failing_download(monkeypatch, make())
    with pytest.raises(models.HubError) as caught:
        models.resolve_model(ID)
    message = str(caught.value)
    assert all(part in message for part in expected), message
    assert "\n" not in message and ID in message


def _not_cached_after(cause: Exception) -> Exception:
    """What snapshot_download raises when the Hub failed and nothing is cached."""
    exc = errors.LocalEntryNotFoundError(f"Got: {type(cause).__name__}: {cause}\nAn error ...")
    exc.__cause__ = cause
    return exc


@pytest.mark.parametrize("model", ["acme/bad name", "acme/two..dots", "acme/-dash", "acme/x?y"])
def test_a_malformed_id_is_named_so(empty_cache, model):
    with pytest.raises(models.HubError, match="nor a valid Hugging Face id"):
        models.resolve_model(model)


def test_a_missing_path_is_still_no_model(tmp_path):
    assert models.resolve_model(str(tmp_path / "nowhere")) is None
    assert models.resolve_model("no-such-built-in") is None


def test_up_says_it_in_one_line_with_status_2(empty_cache, monkeypatch, capsys):
    _failing_download(monkeypatch, _http_error(errors.GatedRepoError, 403, "restricted"))
    assert cli.main(["up", "--model", ID]) == 2
    err = capsys.readouterr().err
    assert err.startswith("evenflow up: error: ") and "is gated" in err
    assert err.count("\n") == 1 and "Traceback" not in err
