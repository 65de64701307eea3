"""A progress bar on stderr for long offline work (loading a model, writing a benchmark
checkpoint, a load run). Callers decide whether to draw one: the offline API and the benchmarks
do when stderr is a terminal; services never do (`evenflow up`'s children share its terminal)."""

from __future__ import annotations

import sys
import time


def on_terminal() -> bool:
    return sys.stderr.isatty()


class Progress:
    """`label [#####.....] done/total`, redrawn at most 10 times a second; no-op if disabled."""

    def __init__(self, label: str, total: int, enabled: bool = True, width: int = 30) -> None:
        self.label, self.total, self.enabled, self.width = label, max(1, total), enabled, width
        self.done, self._drawn_at = 0, 0.0

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._drawn_at > 0.1 or self.done >= self.total):
            self._drawn_at = now
            filled = self.width * min(self.done, self.total) // self.total
            print(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
                  f"{self.done}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.done:
            print(file=sys.stderr, flush=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
