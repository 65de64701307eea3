"""Built-in checkpoints shipped with the package (see README: the tiny-moe model), and how a
model name resolves to a directory. Torch-free and import-free: the engine and the gateway both
use it."""

from __future__ import annotations

import json
from pathlib import Path

BUILTIN_MODELS_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL = "tiny-moe"
MAX_MODEL_LEN_CAP = 8192  # the engine's default context limit, below the model's own if larger


def resolve_model(model: str) -> Path | None:
    """A built-in model's name (`tiny-moe`) or a checkpoint directory; None if neither."""
    builtin = BUILTIN_MODELS_DIR / model
    if "/" not in model and (builtin / "config.json").is_file():
        return builtin
    path = Path(model).expanduser()
    return path if path.is_dir() else None


def default_max_model_len(model_dir: Path, requested: int | None = None) -> int:
    """The context limit the engine serves: the model's, capped."""
    raw = json.loads((model_dir / "config.json").read_text())
    return min(requested or MAX_MODEL_LEN_CAP, int(raw.get("max_position_embeddings", 4096)))
