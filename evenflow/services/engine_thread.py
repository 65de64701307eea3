"""Runs a model engine on a dedicated thread so forward passes never block the event loop.

The loop hands work in as callables (executed on the engine thread between steps, so they never
race a step); each step's outputs come back to the loop through `call_soon_threadsafe`. The
engine object is duck-typed (`step()`, `has_unfinished()`): services never import torch here.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class EngineThread:
    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop,
                 on_outputs: Callable[[list[Any]], None]) -> None:
        self.engine, self._loop, self._on_outputs = engine, loop, on_outputs
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, command: Callable[[], None]) -> None:
        """Run `command` on the engine thread before the next step."""
        self._commands.put(command)

    def stop(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=10)

    def _run_command(self, command: Callable[[], None]) -> None:
        try:
            command()
        except Exception:  # commands report their own errors; this is a last resort
            log.exception("engine command failed")

    def _run(self) -> None:
        configure = getattr(self.engine, "configure_current_thread", None)
        if configure is not None:
            configure()
        while True:
            # Idle: wait for work. Busy: take whatever is queued without waiting, then step.
            commands: list[Callable[[], None] | None] = []
            try:
                if self.engine.has_unfinished():
                    commands.append(self._commands.get_nowait())
                else:
                    commands.append(self._commands.get(timeout=0.5))
                while True:
                    commands.append(self._commands.get_nowait())
            except queue.Empty:
                pass
            for command in commands:
                if command is None:
                    return
                self._run_command(command)
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except Exception:
                    log.exception("engine step failed")
                    outputs = []
                if outputs:
                    self._loop.call_soon_threadsafe(self._on_outputs, outputs)
