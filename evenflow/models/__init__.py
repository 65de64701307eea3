"""Built-in checkpoints shipped with the package (docs/models.md: the tiny-moe model), and how a
model name resolves to a directory: a built-in name, a checkpoint directory, or a Hugging Face
id (`org/name`) through huggingface_hub's cache (offline from a populated cache with
HF_HUB_OFFLINE=1); an id that cannot be had is a `HubError` saying why. Torch-free: the engine
and the gateway both use it."""

from __future__ import annotations

import json
import re
from pathlib import Path

BUILTIN_MODELS_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL = "tiny-moe"
MAX_MODEL_LEN_CAP = 8192  # the engine's default context limit, below the model's own if larger


HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a checkpoint needs of a Hugging Face repository (no other weights formats, no docs)
HF_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt", "*.model"]


class HubError(ValueError):
    """A model named as a Hugging Face id that cannot be had: the message (one line) says why
    (offline and not cached, no network, gated, no such repository or revision, a malformed
    id) and how to serve a local directory instead."""


def resolve_model(model: str) -> Path | None:
    """A built-in model's name (`tiny-moe`), a checkpoint directory, a GGUF file (its converted
    directory: models/gguf_import.py; GGUFError when it cannot be served) or a Hugging Face id
    (HubError when it cannot be had, or is `org/name` with characters an id may not have);
    None if none of these."""
    builtin = BUILTIN_MODELS_DIR / model
    if "/" not in model and (builtin / "config.json").is_file():
        return builtin
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":  # llama.cpp's format: converted once
        from evenflow.models.gguf_import import converted_dir

        return converted_dir(path)
    if is_hub_id(model):
        return from_hub(model)
    if _ID_SHAPED.match(model):  # org/name, but with characters an id may not have
        raise HubError(f"model {model!r} is not a directory, nor a valid Hugging Face id "
                       f"({_ID_RULES})")
    return None


def is_hub_id(model: str) -> bool:
    return bool(HF_ID.match(model)) and not Path(model).expanduser().exists()


_ID_SHAPED = re.compile(r"^[^/~.][^/]*/[^/]+$")  # one slash, not a path from / . or ~
_ID_RULES = ("an id is org/name: letters, digits, '-', '_' and '.', neither part starting or "
             "ending with '-' or '.', no '--' or '..', at most 96 characters")


def from_hub(repo_id: str) -> Path:
    """The repository's snapshot in huggingface_hub's cache (fetched first unless
    HF_HUB_OFFLINE=1); HubError, saying why, when it cannot be had."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise HubError(f"model {repo_id!r} is not a directory, and huggingface_hub (which "
                       "fetches Hugging Face ids) is not installed") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HF_FILES))
    except Exception as exc:  # each cause, said in the user's terms: hub_failure
        raise HubError(hub_failure(repo_id, exc)) from exc


def hub_failure(repo_id: str, exc: BaseException) -> str:
    """One line: why snapshot_download(repo_id) raised `exc`, and what to do about it."""
    from huggingface_hub import constants, errors

    elsewhere = (f"; or download it where the Hub can be reached (`hf download {repo_id} "
                 "--local-dir DIR`) and serve that directory (`evenflow up --model DIR`)")
    login = ("log in with `hf auth login` (or set HF_TOKEN) as an account that may read it")
    cause = exc.__cause__
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, errors.HFValidationError):
        return f"model {repo_id!r} is not a directory, nor a valid Hugging Face id ({_ID_RULES})"
    if isinstance(exc, errors.GatedRepoError):
        return (f"the Hugging Face repository {repo_id!r} is gated: accept its terms at "
                f"https://huggingface.co/{repo_id} and {login}{elsewhere}")
    if isinstance(exc, errors.RepositoryNotFoundError) or status == 401:
        return (f"model {repo_id!r} is not a directory, and the Hugging Face Hub has no "
                f"repository {repo_id!r} (if it is private, {login})")
    if isinstance(exc, errors.RevisionNotFoundError):
        return (f"the Hugging Face repository {repo_id!r} has no revision 'main' (the one "
                f"evenflow fetches){elsewhere}")
    if isinstance(exc, errors.DisabledRepoError):
        return f"the Hugging Face repository {repo_id!r} is disabled{elsewhere}"
    # Not fetched and not (wholly) cached: offline by choice, the network, or the Hub itself
    offline = isinstance(cause, errors.OfflineModeIsEnabled) or constants.HF_HUB_OFFLINE
    not_cached = isinstance(exc, errors.LocalEntryNotFoundError)
    reason = _first_line(cause if not_cached and cause is not None else exc)
    incomplete = getattr(errors, "IncompleteSnapshotError", ())  # (huggingface_hub >= 1.0)
    if incomplete and isinstance(exc, incomplete):
        why = "HF_HUB_OFFLINE=1" if offline or cause is None else reason
        return (f"the local Hugging Face cache holds an incomplete copy of {repo_id!r} and it "
                f"cannot be completed ({why}){elsewhere}")
    if not_cached and offline:
        return (f"model {repo_id!r} is not in the local Hugging Face cache "
                f"({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1 forbids fetching it: unset "
                f"HF_HUB_OFFLINE to download it{elsewhere}")
    if isinstance(cause, errors.HfHubHTTPError) or isinstance(exc, errors.HfHubHTTPError):
        return (f"the Hugging Face Hub failed to serve {repo_id!r} ({reason}) and it is not "
                f"in the local cache; retry later{elsewhere}")
    if not_cached or _unreachable(exc):
        return (f"cannot reach the Hugging Face Hub to fetch {repo_id!r} ({reason}) and it "
                f"is not in the local cache ({constants.HF_HUB_CACHE}): check the network "
                f"(or HF_ENDPOINT, HTTPS_PROXY){elsewhere}")
    return f"could not fetch {repo_id!r} from the Hugging Face Hub ({reason}){elsewhere}"


def _unreachable(exc: BaseException) -> bool:
    """A connection that failed: the builtin errors, or the HTTP client's (httpx's
    TransportError, requests' ConnectionError and Timeout; named, as the client varies with
    huggingface_hub's version)."""
    names = {c.__name__ for c in type(exc).__mro__}
    return isinstance(exc, (ConnectionError, TimeoutError)) or bool(
        names & {"TransportError", "ConnectionError", "Timeout"})


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def output_vocab_size(model_dir: Path) -> int:
    """The model's embedding rows: the token ids it can produce (often a few more than its
    tokenizer has: padding rows)."""
    raw = json.loads((model_dir / "config.json").read_text())
    return int((raw.get("text_config") or raw).get("vocab_size") or 0)


def eos_token_ids(model_dir: Path) -> list[int]:
    """The token ids that end a sequence, as config.json and generation_config.json name
    them (an id or a list)."""
    found: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        raw = json.loads(path.read_text())
        value = (raw.get("text_config") or raw).get("eos_token_id", raw.get("eos_token_id"))
        found += [int(v) for v in (value if isinstance(value, list) else [value])
                  if isinstance(v, int)]
    return found


def default_max_model_len(model_dir: Path, requested: int | None = None) -> int:
    """The context limit the engine serves: the model's, capped."""
    raw = json.loads((model_dir / "config.json").read_text())
    return min(requested or MAX_MODEL_LEN_CAP, int(raw.get("max_position_embeddings", 4096)))
