"""`n` choices for one request: each runs as a request of its own (its id suffixed, its seed
offset by its index so seeded choices differ yet reproduce), and their pieces are merged as they
come, tagged with the choice's index. Their shared prompt is computed once where it can be: the
KV-aware router sends later choices to the worker that holds it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

T = TypeVar("T")
_DONE = object()


async def merged(runs: list[Callable[[], AsyncIterator[T]]]) -> AsyncIterator[tuple[int, T]]:
    """(index, item) from every run, in arrival order; the first run to fail fails them all
    (the others are cancelled)."""
    if len(runs) == 1:
        async for item in runs[0]():
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | object | None]] = asyncio.Queue()

    async def pump(index: int, run: Callable[[], AsyncIterator[T]]) -> None:
        try:
            async for item in run():
                await queue.put((index, item, None))
        except Exception as exc:
            await queue.put((index, None, exc))
        finally:
            await queue.put((index, None, _DONE))

    tasks = [asyncio.create_task(pump(i, run)) for i, run in enumerate(runs)]
    try:
        running = len(runs)
        while running:
            index, item, status = await queue.get()
            if status is _DONE:
                running -= 1
            elif isinstance(status, BaseException):
                raise status
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
