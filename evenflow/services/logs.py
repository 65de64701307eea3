"""Every service's log output: formatted and written to stderr by a thread of its own, so that
a service's event loop only queues a record (a request line per request at the gateway was ~4%
of its CPU at 16 streams, most of it the formatting and the write to stderr, measured with
py-spy). Records still queued when the process ends are written first: `drain()` runs at exit,
and a process that ends with os._exit calls it before (services/engine_thread.exit_worker).
(logging.shutdown alone is not enough: logging.config.dictConfig, which uvicorn calls at start,
closes every handler and drops them from logging's own list of handlers to flush at exit.)"""

from __future__ import annotations

import atexit
import logging
import logging.handlers
import queue
import sys
import threading
import weakref

_LIVE: weakref.WeakSet[logging.Handler] = weakref.WeakSet()


class _QueuedHandler(logging.handlers.QueueHandler):
    """A QueueHandler that owns its writer thread: closing it writes what is queued and stops
    the thread; a record that comes after (the handler still attached) starts it again, as
    logging.config.dictConfig closes every existing handler - uvicorn calls it at start.
    Each writer thread reads a queue of its own: with one shared queue, a record logged while
    close() ran (another thread's) started the next writer on that queue, which could take the
    stopping writer's end marker - and close(), joining a writer that never saw it, hung the
    process on its way out (a worker that lost its tensor-parallel rank never ended)."""

    def __init__(self, target: logging.Handler) -> None:
        super().__init__(queue.SimpleQueue())
        # the record's own text (and traceback) made here; the stderr format in the writer
        self.setFormatter(logging.Formatter("%(message)s"))
        self.target = target
        self.listener: logging.handlers.QueueListener | None = None
        self._starting = threading.Lock()  # held while the writer (and its queue) changes
        with self._starting:
            self._start()
        _LIVE.add(self)

    def _start(self) -> None:
        """A writer on a fresh queue (the caller holds self._starting)."""
        records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        listener = logging.handlers.QueueListener(records, self.target,
                                                  respect_handler_level=True)
        listener.start()
        self.queue, self.listener = records, listener

    def emit(self, record: logging.LogRecord) -> None:
        try:
            prepared = self.prepare(record)  # the formatting, outside the lock
        except Exception:
            self.handleError(record)
            return
        with self._starting:  # never onto a queue whose writer is stopping
            if self.listener is None:
                self._start()
            self.enqueue(prepared)

    def close(self) -> None:
        with self._starting:
            listener, self.listener = self.listener, None
        if listener is not None:
            listener.stop()  # writes its queue's records, then joins its writer thread
        self.target.flush()
        super().close()


def drain() -> None:
    """Write every record still queued (and stop the writer threads) before the process ends."""
    for handler in list(_LIVE):
        handler.close()


atexit.register(drain)


def configure(level: str, fmt: str) -> None:
    """The root logger at `level`, its records written to stderr in `fmt` off the caller's
    thread; replaces whatever handlers the root logger had (as basicConfig(force=True))."""
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setFormatter(logging.Formatter(fmt))
    logging.basicConfig(level=level.upper(), force=True, handlers=[_QueuedHandler(stderr)])
