"""Prefill service: prompt -> KV blocks -> decode worker, first token -> gateway.

Not built yet: this package is reserved by the layout in DESIGN.md."""
