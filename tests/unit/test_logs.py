"""Service logs: every record reaches stderr in the service's format, in order, tracebacks
included, also when the process ends at once right after logging (as exit_worker does)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import logging, os, threading
    from evenflow.services.config import MeshConfig
    MeshConfig().configure_logging("decode/d7")
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
    log.critical("the last words")
    logging.shutdown()
    os._exit(70)
""")


def test_records_are_written_in_order_and_drained_before_exit() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 70
    lines = proc.stderr.splitlines()
    assert "not shown" not in proc.stderr
    infos = [line for line in lines if " INFO [decode/d7] evenflow.test line " in line]
    assert [int(line.rsplit(" ", 1)[1]) for line in infos] == list(range(200))
    assert any(" WARNING [decode/d7] evenflow.test from a thread" in line for line in lines)
    assert "ZeroDivisionError: division by zero" in proc.stderr
    assert lines[-1].endswith(" CRITICAL [decode/d7] evenflow.test the last words")
