"""Decode service: KV blocks in -> continuous batching -> token deltas out.

Not built yet: this package is reserved by the layout in DESIGN.md."""
