"""`build_engine`: the one way services (and tests) make an engine by kind: the real one, an
expert-parallel rank of a DEP group, or the mock. Engine modules are imported when asked for,
so importing this costs nothing (the gateway, torch-free, imports evenflow.engine.config)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from evenflow.engine.core.block_manager import KVEventListener
    from evenflow.engine.serving.engine import Engine, EngineConfig


def build_engine(kind: str, config: EngineConfig,
                  kv_event_listener: KVEventListener | None = None,
                  collect_kv_events: bool = False, ep_rank: int = 0,
                  ep_group: str = "", mock_timing_scale: float = 1.0,
                  mock_profile: str = "") -> Engine:
    """`torch`: the real engine; `mock`: the same scheduler and cache with a timing model.
    A serving engine collects its KV events for take_kv_events() (collect_kv_events). With
    config.expert_parallel_size > 1, this is rank `ep_rank` of the DEP group named `ep_group`
    (engine/dep/lockstep.py). The mock engine's modelled step times are scaled by
    mock_timing_scale (0: no compute at all, to measure everything around the engine); with
    mock_profile (the JSON `evenflow profile-roles` writes), its step costs are those measured
    from the real engine."""
    if kind == "torch" and config.expert_parallel_size > 1:
        from evenflow.engine.dep.lockstep import LockstepEngine

        return LockstepEngine(config, kv_event_listener, collect_kv_events, ep_rank, ep_group)
    if kind == "torch":
        from evenflow.engine.serving.engine import Engine

        return Engine(config, kv_event_listener, collect_kv_events)
    if kind == "mock":
        import dataclasses

        from evenflow.engine.api.mock import MockEngine, MockTiming

        mock = MockEngine(config, kv_event_listener, collect_kv_events)
        timing = MockTiming.from_profile(mock_profile) if mock_profile else mock.timing
        mock.runner.timing = MockTiming(**{  # type: ignore[attr-defined]
            f.name: getattr(timing, f.name) * mock_timing_scale
            for f in dataclasses.fields(timing)})
        if mock.runner.timing.engine_build_s > 0:  # type: ignore[attr-defined]
            import time

            time.sleep(mock.runner.timing.engine_build_s)  # type: ignore[attr-defined]
        return mock
    raise ValueError(f"unknown engine {kind!r}: torch or mock")
