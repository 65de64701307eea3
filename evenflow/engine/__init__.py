"""The model in PyTorch: HF checkpoint loading, MoE transformer, paged KV cache with prefix
caching, continuous-batching scheduler, sampler and the offline `LLM` API.

Floors, lowest first; a module imports only from its own floor and those below it, with no
circles (tests/unit/test_import_rules.py; `python scripts/import_graph.py` prints the graph):

 0. config.py           torch-free settings (EngineConfig, ModelConfig, the EVENFLOW_* engine
                        switches); anyone in evenflow may read it
 1. core/               sequences, sampling params, block manager (prefix cache), scheduler
 2. kernels/            the C++ kernels and their Python side (build, switches, panels, plan)
 3. sample/             sampler, logits processing, guided decoding
 4. quant/              quantized weight forms, each with its tensors and its linear
 5. model/              layers (attention, norms, MLP, MoE, router, placement), the decoder
                        wired from a ModelConfig, the native decode stack
 6. weights/            safetensors, HF names, loading, GPTQ, prepacking, TP shards, expert store
 7. runners/            the model runner (KV cache, forward, sample), tensor-parallel ranks and
                        the typed commands between ranks
 8. placement_control.py, prefix_transfer.py, profiling.py   the Engine's expert-placement,
    KV-pull and profiling parts
 9. engine.py           Engine: add / abort / step, KV export and import, KV events
10. dep/                expert parallelism with data-parallel attention: several Engines in
                        lockstep (above engine.py because each rank is one)
11. mock.py, llm.py, this file   the mock engine, the offline LLM API, create_engine
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from evenflow.engine.core.block_manager import KVEventListener
    from evenflow.engine.engine import Engine, EngineConfig


def create_engine(kind: str, config: EngineConfig,
                  kv_event_listener: KVEventListener | None = None,
                  collect_kv_events: bool = False, ep_rank: int = 0,
                  ep_group: str = "", mock_timing_scale: float = 1.0) -> Engine:
    """`torch`: the real engine; `mock`: the same scheduler and cache with a timing model.
    A serving engine collects its KV events for take_kv_events() (collect_kv_events). With
    config.expert_parallel_size > 1, this is rank `ep_rank` of the DEP group named `ep_group`
    (engine/dep/lockstep.py). The mock engine's modelled step times are scaled by
    mock_timing_scale (0: no compute at all, to measure everything around the engine)."""
    if kind == "torch" and config.expert_parallel_size > 1:
        from evenflow.engine.dep.lockstep import LockstepEngine

        return LockstepEngine(config, kv_event_listener, collect_kv_events, ep_rank, ep_group)
    if kind == "torch":
        from evenflow.engine.engine import Engine

        return Engine(config, kv_event_listener, collect_kv_events)
    if kind == "mock":
        import dataclasses

        from evenflow.engine.mock import MockEngine, MockTiming

        mock = MockEngine(config, kv_event_listener, collect_kv_events)
        mock.runner.timing = MockTiming(**{  # type: ignore[attr-defined]
            f.name: getattr(mock.timing, f.name) * mock_timing_scale
            for f in dataclasses.fields(mock.timing)})
        return mock
    raise ValueError(f"unknown engine {kind!r}: torch or mock")
