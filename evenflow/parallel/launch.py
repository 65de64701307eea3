"""Start N rank processes on this host and collect their results (tests, benchmarks, and the
engine's rank processes): each runs `target(rank, world_size, *args)`; a rank that raises or
dies fails the whole run; every rank is killed on the way out, whatever happened."""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any


class RankFailed(RuntimeError):
    pass


def _entry(target: Callable[..., Any], rank: int, world: int, args: tuple, results: Any) -> None:
    try:
        results.put((rank, True, target(rank, world, *args)))
    except BaseException as exc:  # reported to the parent, which fails the run
        results.put((rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_ranks(target: Callable[..., Any], world_size: int, *args: Any,
              timeout_s: float = 120.0, keep_going: bool = False) -> list[Any]:
    """Each rank's return value, by rank (plain Python values: tensors would travel as
    shared-memory handles that die with the rank). keep_going: a rank that dies gets None and
    the others carry on (fault tests)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(target, r, world_size, args, results),
                         daemon=True) for r in range(world_size)]
    out: dict[int, Any] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                        and r not in out]
                if dead and keep_going:
                    out.update({r: None for r in dead})
                elif dead:
                    raise RankFailed(f"rank(s) {dead} died (exit codes "
                                     f"{[procs[r].exitcode for r in dead]})") from None
                if time.monotonic() > deadline:
                    raise RankFailed(f"ranks timed out after {timeout_s:g} s") from None
                continue
            if not ok:
                raise RankFailed(f"rank {rank} failed: {value}")
            out[rank] = value
        return [out[r] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        results.close()
