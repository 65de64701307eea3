"""Decode service: KV blocks in -> continuous batching -> token deltas out (service.py); also
prefills short prompts itself (conditional disaggregation). `python -m evenflow.decode ID`."""
