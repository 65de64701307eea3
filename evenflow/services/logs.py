"""Every service's log output: formatted and written to stderr by a thread of its own, so that
a service's event loop only queues a record (a request line per request at the gateway was ~4%
of its CPU at 16 streams, most of it the formatting and the write to stderr, measured with
py-spy). Records still queued when the process ends are written first (logging.shutdown,
which also runs at exit, closes the handler, and that drains the queue)."""

from __future__ import annotations

import logging
import logging.handlers
import queue
import sys


class _QueuedHandler(logging.handlers.QueueHandler):
    """A QueueHandler that owns its listener: closing it writes what is queued and stops it."""

    def __init__(self, target: logging.Handler) -> None:
        records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        super().__init__(records)
        # the record's own text (and traceback) made here; the stderr format in the writer
        self.setFormatter(logging.Formatter("%(message)s"))
        listener = logging.handlers.QueueListener(records, target, respect_handler_level=True)
        listener.start()
        self.listener: logging.handlers.QueueListener | None = listener

    def close(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.stop()  # writes the queued records, then joins the writer thread
            for handler in listener.handlers:
                handler.close()
        super().close()


def configure(level: str, fmt: str) -> None:
    """The root logger at `level`, its records written to stderr in `fmt` off the caller's
    thread; replaces whatever handlers the root logger had (as basicConfig(force=True))."""
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setFormatter(logging.Formatter(fmt))
    logging.basicConfig(level=level.upper(), force=True, handlers=[_QueuedHandler(stderr)])
