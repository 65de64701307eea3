"""Simulated hosts (evenflow/dev/hosts.py) for tests of what spans several machines: skipped,
with the reason, where this machine cannot make network namespaces; always torn down."""

from __future__ import annotations

import pytest

from evenflow.dev.hosts import HostsUnavailable, SimCluster, probe


@pytest.fixture(scope="module")
def three_hosts():
    why = probe()
    if why is not None:
        pytest.skip(f"simulated hosts unavailable here: {why}")
    try:
        cluster = SimCluster.create(3, rate="10gbit")
    except HostsUnavailable as exc:  # (create removed what it had made)
        pytest.skip(f"simulated hosts unavailable here: {exc}")
    try:
        yield cluster
    finally:
        cluster.close()
