"""Prefill service: prompt -> KV blocks -> decode worker, first token -> gateway (service.py).
`python -m evenflow.prefill ID`."""
