"""Torch-free settings anyone in evenflow may read: the engine's and a model's (settings.py)
and each family's config.json -> ModelConfig (families.py)."""
