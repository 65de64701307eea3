"""Scheduling and the KV cache's bookkeeping: a request inside the engine (sequence), its
sampling parameters, the block manager (prefix cache, ref counts, KV events) and the
continuous-batching scheduler. Pure Python; imports only engine.config (settings) and proto."""
