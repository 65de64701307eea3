"""`evenflow doctor` names a straggler by comparing each worker with the median of the OTHER
workers of its role (ops/stragglers.py): two workers, one 2x slower, name exactly that one;
equal workers and timing noise name none. And its default workload reaches every role."""

from __future__ import annotations

import pytest

from evenflow.ops import doctor
from evenflow.ops.doctor_metrics import worker_instances
from evenflow.ops.stragglers import STANDS_OUT, against_peers, stragglers
from evenflow.services.config import MeshConfig


def test_of_two_workers_the_one_twice_as_slow_is_named_and_not_its_peer():
    # measured on `evenflow up --decode 2` with d1 SIGSTOPped 60% of the time
    compared = against_peers({"d0": 1.37, "d1": 2.77})
    assert compared["d1"].vs_peers == pytest.approx(2.77 / 1.37)
    assert compared["d0"].vs_peers == pytest.approx(1.37 / 2.77)  # faster: never named
    assert stragglers({"d0": 1.37, "d1": 2.77}) == ["d1"]


def test_of_three_workers_the_slow_one_is_named():
    assert stragglers({"d0": 1.0, "d1": 1.1, "d2": 2.0}) == ["d2"]
    assert stragglers({"d0": 2.0, "d1": 1.0, "d2": 2.1, "d3": 1.05}) == ["d2", "d0"]
    # one fast worker does not make the two others stragglers
    assert stragglers({"d0": 0.3, "d1": 1.0, "d2": 1.0}) == []


def test_equal_workers_and_noise_name_no_one():
    assert stragglers({"d0": 1.0, "d1": 1.0}) == []
    assert stragglers({"d0": 1.0, "d1": 1.2}) == []  # 1.2x: noise on a shared host
    assert stragglers({"d0": 1.0, "d1": 1.2, "d2": 1.1}) == []
    assert stragglers({"d0": 1.0}) == [] and against_peers({"d0": 1.0})["d0"].vs_peers == 1.0
    assert STANDS_OUT == 1.5


def _beats(costs_s: dict[str, float]) -> tuple[dict, dict]:
    """The gateway's re-exported heartbeat counters over a window: decode workers that each
    streamed 1,000 tokens at the given seconds per token."""
    before, after = {}, {}
    for worker, cost in costs_s.items():
        labels = (("role", "decode"), ("worker", worker))
        before[("evenflow_worker_step_seconds", labels)] = 0.0
        after[("evenflow_worker_step_seconds", labels)] = 0.0
        before[("evenflow_worker_stream_seconds", labels)] = 0.0
        before[("evenflow_worker_stream_tokens", labels)] = 0.0
        after[("evenflow_worker_stream_seconds", labels)] = cost * 1000
        after[("evenflow_worker_stream_tokens", labels)] = 1000.0
    return before, after


def test_the_verdict_names_only_the_slow_worker_of_two():
    instances = worker_instances(*_beats({"d0": 0.00137, "d1": 0.00277}))
    verdict = doctor._verdict([], instances, None, [])
    assert "slowest instance: decode d1" in verdict and "d0" not in verdict
    even = doctor._verdict([], worker_instances(*_beats({"d0": 0.001, "d1": 0.0012})), None, [])
    assert even.startswith("no instance stands out")


def test_the_default_workload_reaches_the_prefill_workers():
    """Prompts under the gateway's local-prefill threshold are prefilled on the decode worker:
    the default workload has some over it, and short ones too."""
    lengths, _, requests, _ = doctor.WORKLOADS["chat"]
    threshold = MeshConfig().local_prefill_threshold
    sent = doctor.prompt_lengths(lengths, requests)
    assert len(sent) == requests
    assert sum(n >= 2 * threshold for n in sent) >= requests // 5
    assert any(n < threshold for n in sent)
    for name, (lengths, *_rest) in doctor.WORKLOADS.items():
        assert max(lengths) >= 2 * threshold, name
