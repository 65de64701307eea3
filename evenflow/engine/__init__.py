"""The model in PyTorch: HF checkpoint loading, MoE transformer, paged KV cache with prefix
caching, continuous-batching scheduler, sampler and the offline `LLM` API."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from evenflow.engine.block_manager import KVEventListener
    from evenflow.engine.engine import Engine, EngineConfig


def create_engine(kind: str, config: EngineConfig,
                  kv_event_listener: KVEventListener | None = None) -> Engine:
    """`torch`: the real engine; `mock`: the same scheduler and cache with a timing model."""
    if kind == "torch":
        from evenflow.engine.engine import Engine

        return Engine(config, kv_event_listener)
    if kind == "mock":
        from evenflow.engine.mock import MockEngine

        return MockEngine(config, kv_event_listener)
    raise ValueError(f"unknown engine {kind!r}: torch or mock")
