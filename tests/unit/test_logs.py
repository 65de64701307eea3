"""Service logs: every record reaches stderr in the service's format, in order, tracebacks
included, also when a worker ends at once right after logging (exit_worker, os._exit) and
after a library reconfigured logging (uvicorn's dictConfig closes every existing handler)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import logging, logging.config, os, threading
    from evenflow.services.config import MeshConfig
    MeshConfig().configure_logging("decode/d7")
    logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})
    log = logging.getLogger("evenflow.test")
    log.debug("not shown at INFO")
    for i in range(200):
        log.info("line %d", i)
    t = threading.Thread(target=lambda: log.warning("from a thread"))
    t.start(); t.join()
    try:
        1 / 0
    except ZeroDivisionError:
        log.exception("it failed")
    from evenflow.services.engine_thread import exit_worker
    exit_worker("the last words")
""")


def test_records_are_written_in_order_and_drained_before_exit() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 70  # exit_worker's status
    lines = proc.stderr.splitlines()
    assert "not shown" not in proc.stderr
    infos = [line for line in lines if " INFO [decode/d7] evenflow.test line " in line]
    assert [int(line.rsplit(" ", 1)[1]) for line in infos] == list(range(200))
    assert any(" WARNING [decode/d7] evenflow.test from a thread" in line for line in lines)
    assert "ZeroDivisionError: division by zero" in proc.stderr
    assert "the last words" in lines[-1] and " CRITICAL [decode/d7] " in lines[-1]


def test_closing_while_another_thread_logs_never_hangs() -> None:
    """A worker's engine thread drains the logs on its way out (exit_worker) while its event
    loop thread still logs: each close must end, every record written."""
    import io
    import logging
    import threading

    from evenflow.services import logs

    out = io.StringIO()
    handler = logs._QueuedHandler(logging.StreamHandler(out))
    record = logging.LogRecord("evenflow.test", logging.INFO, __file__, 1, "busy", None, None)
    stop, written = threading.Event(), [0]

    def busy() -> None:
        while not stop.is_set():
            handler.handle(record)
            written[0] += 1

    threads = [threading.Thread(target=busy) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(300):
            closing = threading.Thread(target=handler.close, daemon=True)
            closing.start()
            closing.join(10)
            assert not closing.is_alive(), "close() hung while another thread logged"
    finally:
        stop.set()
        for t in threads:
            t.join()
        handler.close()
    assert out.getvalue().count("busy\n") == written[0]
