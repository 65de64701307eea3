"""Built-in checkpoints shipped with the package (see README: the tiny-moe model), and how a
model name resolves to a directory: a built-in name, a checkpoint directory, or a Hugging Face
id (`org/name`) through huggingface_hub's cache (offline from a populated cache with
HF_HUB_OFFLINE=1). Torch-free: the engine and the gateway both use it."""

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


def resolve_model(model: str) -> Path | None:
    """A built-in model's name (`tiny-moe`), a checkpoint directory, a GGUF file (its converted
    directory: models/gguf_import.py; GGUFError when it cannot be served) or a Hugging Face id;
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
    return from_hub(model) if is_hub_id(model) else None


def is_hub_id(model: str) -> bool:
    return bool(HF_ID.match(model)) and not Path(model).expanduser().exists()


def from_hub(repo_id: str) -> Path | None:
    """The repository's snapshot in huggingface_hub's cache (fetched first unless
    HF_HUB_OFFLINE=1); None when it cannot be had."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HF_FILES))
    except Exception:  # offline and not cached, unknown repository, network down
        return None


def output_vocab_size(model_dir: Path) -> int:
    """The model's embedding rows: the token ids it can produce (often a few more than its
    tokenizer has: padding rows)."""
    raw = json.loads((model_dir / "config.json").read_text())
    return int((raw.get("text_config") or raw).get("vocab_size") or 0)


def default_max_model_len(model_dir: Path, requested: int | None = None) -> int:
    """The context limit the engine serves: the model's, capped."""
    raw = json.loads((model_dir / "config.json").read_text())
    return min(requested or MAX_MODEL_LEN_CAP, int(raw.get("max_position_embeddings", 4096)))
