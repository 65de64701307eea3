"""Helpers shared by the integration tests."""

from __future__ import annotations

import time

API_KEY = "test-key"  # the integration mesh requires it


def wait_for(predicate, timeout: float = 8.0, interval: float = 0.05) -> bool:
    """Poll `predicate` until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False
