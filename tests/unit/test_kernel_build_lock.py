"""The native kernels' build lock: a process that finds another building waits for it (and says
so), instead of compiling the same sources at the same time."""

from __future__ import annotations

import multiprocessing as mp
import time

from evenflow.engine.kernels.native_build import build_lock


def _hold(where: str, held: mp.synchronize.Event, seconds: float) -> None:
    from pathlib import Path

    with build_lock(Path(where)):
        held.set()
        time.sleep(seconds)


def test_a_second_process_waits_for_the_first_build(tmp_path):
    ctx = mp.get_context("spawn")
    held = ctx.Event()
    builder = ctx.Process(target=_hold, args=(str(tmp_path), held, 1.0))
    builder.start()
    try:
        assert held.wait(60)
        started = time.monotonic()
        with build_lock(tmp_path) as waited:
            assert waited
            assert not builder.is_alive() or time.monotonic() - started > 0.2
        with build_lock(tmp_path) as waited_again:
            assert not waited_again  # nobody else holds it now
    finally:
        builder.join(10)
        if builder.is_alive():
            builder.kill()
