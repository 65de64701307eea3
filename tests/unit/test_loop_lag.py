"""The event-loop lag watcher every service runs: a loop blocked for longer than the threshold
is logged as a warning (at most once per interval), and counted in the lag histogram."""

from __future__ import annotations

import asyncio
import logging
import time

from evenflow.services.metrics import LOOP_LAG, watch_loop_lag


def _lag_samples() -> float:
    return next(s.value for s in LOOP_LAG.collect()[0].samples if s.name.endswith("_count"))


def test_a_blocked_loop_is_warned_about_once_per_interval(caplog):
    async def scenario() -> None:
        watcher = asyncio.create_task(watch_loop_lag(warn_s=0.05, warn_every_s=60))
        await asyncio.sleep(0.12)  # a few on-time ticks
        for _ in range(3):
            time.sleep(0.2)  # blocks the loop: the watcher's timer fires ~150 ms late
            await asyncio.sleep(0.08)
        watcher.cancel()

    before = _lag_samples()
    with caplog.at_level(logging.WARNING, logger="evenflow.services.metrics"):
        asyncio.run(scenario())
    warnings = [r.getMessage() for r in caplog.records if "event loop lagged" in r.getMessage()]
    assert len(warnings) == 1  # three lags, one warning within the interval
    assert int(warnings[0].split()[3]) >= 100  # "event loop lagged N ms"
    assert _lag_samples() >= before + 4
