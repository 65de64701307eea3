"""The model in PyTorch: HF checkpoint loading, MoE transformer, paged KV cache with prefix
caching, continuous-batching scheduler, sampler and the offline `LLM` API. Every module lives in
a sub-package; this file only names the entry point (`build_engine`, api/factory.py).

Floors, lowest first; a module imports only from its own floor and those below it, with no
circles (tests/unit/test_import_rules.py; `python scripts/import_graph.py` prints the graph):

 0. config/     torch-free settings (EngineConfig, ModelConfig, the EVENFLOW_* engine switches:
                settings.py) and each family's config.json -> ModelConfig (families.py); anyone
                in evenflow may read them
 1. core/       sequences, sampling params, block manager (prefix cache), scheduler
 2. kernels/    the C++ kernels and their Python side (build, switches, panels, plan)
 3. sample/     sampler, logits processing, guided decoding
 4. quant/      quantized weight forms, each with its tensors and its linear
 5. model/      layers (attention, norms, MLP, MoE, router, placement), the decoder wired from a
                ModelConfig, the native decode stack
 6. weights/    safetensors, HF names, loading, GPTQ, prepacking, TP shards, expert store
 7. runners/    the model runner (KV cache, forward, sample), tensor-parallel ranks and the typed
                commands between ranks
 8. serving/    Engine (add / abort / step, KV export and import, KV events) and its parts:
                expert placement, KV pulls, operator profiles
 9. dep/        expert parallelism with data-parallel attention: several Engines in lockstep
                (above serving/ because each rank is one)
10. api/, this file   the offline LLM API, the mock engine, build_engine
"""

from __future__ import annotations

from evenflow.engine.api.factory import build_engine

__all__ = ["build_engine"]
