"""Built-in checkpoints shipped with the package (see README: the tiny-moe model)."""
