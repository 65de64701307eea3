"""The doctor's reading of a gateway's /metrics (ops/doctor_metrics.py) and the gateway's own
split of a request's time to first token (gateway/timings.py): the phases follow each other
with no gap, so they add up to the gateway's total, and the workers' heartbeat figures give each
one's cost per token against its peers."""

from __future__ import annotations

import pytest

from evenflow.gateway.timings import PHASES as GATEWAY_PHASES
from evenflow.gateway.timings import FirstTokenTimings
from evenflow.ops.doctor_metrics import PHASE_METRIC, PHASES, phase_rows, worker_instances


def test_the_gateway_phases_add_up_to_its_time_to_first_token():
    t = FirstTokenTimings(received=10.0, tokenized=10.001, admitted=10.0015)
    t.published = 10.003
    t.first, t.queued_s, t.computed_s = 10.030, 0.004, 0.020
    phases = t.phases(chunk=10.031)
    assert tuple(k for k in phases if k != "total") == GATEWAY_PHASES == PHASES
    assert sum(v for k, v in phases.items() if k != "total") == pytest.approx(phases["total"])
    assert phases["worker compute"] == pytest.approx(0.020)
    assert phases["NATS hops"] == pytest.approx(0.003)
    # a worker claiming more than the whole interval (clocks, rounding) is capped by it
    t.queued_s, t.computed_s = 0.010, 0.030
    capped = t.phases(chunk=10.031)
    assert capped["NATS hops"] == 0 and capped["worker queue"] + capped["worker compute"] == \
        pytest.approx(0.027)


def _phases(means_ms: dict[str, float], count: int) -> dict:
    samples = {}
    for phase, ms in means_ms.items():
        key = (("phase", phase),)
        samples[(PHASE_METRIC + "_count", key)] = float(count)
        samples[(PHASE_METRIC + "_sum", key)] = ms / 1e3 * count
    return samples


def test_phase_rows_name_the_client_side_and_leave_the_rest_unattributed():
    means = {"tokenize": 1, "admission": 0, "route": 2, "worker queue": 3,
             "worker compute": 20, "NATS hops": 2, "first chunk": 1, "total": 30}
    rows = {r["phase"]: r for r in phase_rows({}, _phases(means, 10), client_ttft_mean_s=0.040)}
    assert rows["gateway: worker compute"]["mean"] == pytest.approx(20)
    assert rows["gateway: worker compute"]["share"] == pytest.approx(0.5)
    assert rows["HTTP and client (client TTFT - gateway TTFT)"]["mean"] == pytest.approx(10)
    assert rows["unattributed"]["mean"] == pytest.approx(1)  # 30 - 29 inside the gateway
    assert phase_rows({}, {}, 0.04) == []  # an older gateway: no phases


def test_worker_instances_compare_each_worker_with_its_peers_over_the_window():
    def beat(role: str, worker: str, seconds: float, tokens: float) -> dict:
        labels = (("role", role), ("worker", worker))
        kind = ("step_seconds", "prompt_tokens_computed") if role == "prefill" else \
            ("stream_seconds", "stream_tokens")
        return {("evenflow_worker_step_seconds", labels): 0.0,
                (f"evenflow_worker_{kind[0]}", labels): seconds,
                (f"evenflow_worker_{kind[1]}", labels): tokens}

    before = {**beat("prefill", "p0", 1, 100), **beat("decode", "d0", 5, 500),
              **beat("decode", "d1", 5, 500)}
    after = {**beat("prefill", "p0", 2, 1100), **beat("decode", "d0", 6, 600),
             **beat("decode", "d1", 9, 600), **beat("decode", "d2", 1, 50)}  # d2: new
    got = {i["worker"]: i for i in worker_instances(before, after)}
    assert got["p0"]["ms_per_token"] == pytest.approx(1.0)
    assert got["d1"]["ms_per_token"] == pytest.approx(40.0)
    assert got["d1"]["vs_peers"] > got["d0"]["vs_peers"]
    assert set(got) == {"p0", "d0", "d1", "d2"}
