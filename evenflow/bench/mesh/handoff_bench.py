"""`evenflow bench serve`'s last table: the one-message K/V hand-off against chunks + completion.

Two local meshes at once (gateway, 1 prefill and 1 decode worker each, every prompt
disaggregated), one with the one-message hand-off (`kv_inline_handoff`: K/V that fits in one
chunk travels inside the completion message) and one without (a chunk message, then the
completion), driven in alternation with batches of 16 streamed requests of 128-token prompts:
the first gap of each stream (first token -> second: the prefill -> decode hand-off) as a p50
per mesh, and the gaps after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from evenflow.bench.loadgen import RequestTiming, make_prompts, one_request, run_client
from evenflow.bench.sse_client import SSEClient

T = TypeVar("T")


async def _gaps(urls: dict[str, str], model: str, vocab: int, rounds: int, out_len: int
                ) -> dict[str, tuple[list[float], list[float]]]:
    gaps: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in urls}
    async with contextlib.AsyncExitStack() as stack:
        clients = {name: await stack.enter_async_context(SSEClient(url, timeout_s=300))
                   for name, url in urls.items()}
        for client in clients.values():  # warm-up
            await asyncio.gather(*(one_request(client, model, p, 2, {})
                                   for p in make_prompts(2, 128, vocab, seed=90)))
        for r in range(rounds):
            for name, client in clients.items():
                outcomes = await asyncio.gather(*(
                    one_request(client, model, p, out_len, {})
                    for p in make_prompts(16, 128, vocab, seed=1000 + r)),
                    return_exceptions=True)
                for t in outcomes:
                    if isinstance(t, RequestTiming) and len(t.itls) > 1:
                        gaps[name][0].append(t.itls[0])
                        gaps[name][1].append(statistics.fmean(t.itls[1:]))
    return gaps


def side_by_side(model: str, variants: dict[str, dict[str, Any]],
                 drive: Callable[[dict[str, str], str], Coroutine[Any, Any, T]]) -> T:
    """Start a local mesh per variant (1 prefill and 1 decode worker, every prompt
    disaggregated, one thread each, plus the variant's settings), run `drive(urls by variant,
    served model name)` against them and stop them all, also when something fails."""
    from evenflow.services.config import MeshConfig
    from evenflow.services.launcher import LocalMesh

    meshes: dict[str, LocalMesh] = {}
    try:
        for name, settings in variants.items():
            mesh = LocalMesh(MeshConfig(**{
                "model": model, "port": 0, "num_prefill": 1, "num_decode": 1,
                "local_prefill_threshold": 0, "num_threads": 1, "kv_cache_gb": 0.5,
                "num_ep_ranks": 0, **settings}))
            meshes[name] = mesh
            mesh.start(health_timeout_s=300)
        first = next(iter(meshes.values()))
        return run_client(drive({name: m.url for name, m in meshes.items()},
                                first.config.model_name))
    finally:
        for mesh in meshes.values():
            mesh.stop()


def handoff_table(model: str, vocab: int, rounds: int, out_len: int) -> None:
    """Print the table (starts and stops both meshes)."""
    from evenflow.services.config import MeshConfig

    gaps = side_by_side(model, {"one message": {"kv_inline_handoff": True},
                                "chunk + completion": {"kv_inline_handoff": False}},
                        lambda urls, name: _gaps(urls, name, vocab, rounds, out_len))
    chunk_bytes = MeshConfig().kv_chunk_bytes
    print(f"\nthe K/V hand-off in one message (K/V that fits one {chunk_bytes} "
          f"B chunk inside the completion) against a chunk and a completion: batch 16, "
          f"128-token prompts, {rounds} alternating rounds, p50 (ms)")
    print(f"{'hand-off':22} {'first gap':>10} {'gaps after':>11} {'streams':>8}")
    base = None
    for name, (first_gaps, rest) in gaps.items():
        if not first_gaps:
            print(f"{name:22} {'-':>10} {'-':>11} {0:8d}")
            continue
        gap = statistics.median(first_gaps) * 1e3
        base = base or gap
        print(f"{name:22} {gap:10.2f} {statistics.median(rest) * 1e3:11.2f} "
              f"{len(first_gaps):8d}   {gap / base:.2f}x the first row's first gap")
