"""POST /admin/profile: a worker of a running mesh profiles its next steps with torch.profiler
and the gateway answers with the operator table and the worker's Chrome trace; unknown workers
and bad arguments are refused; with no traffic the window ends at its timeout."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest
from meshutil import running_mesh

from evenflow.services.config import MeshConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def profiled_mesh(tmp_path_factory):
    with running_mesh(MeshConfig(port=0, num_prefill=0, num_decode=1, num_ep_ranks=0,
                                 profile_dir=str(tmp_path_factory.mktemp("profiles")))) as mesh:
        yield mesh


def test_a_worker_profiles_its_next_steps(profiled_mesh):
    url = profiled_mesh.url
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        asked = pool.submit(httpx.post, url + "/admin/profile",
                            params={"worker": "d0", "steps": 4, "timeout": 60}, timeout=120)
        for _ in range(3):  # traffic for the window (it ends after 4 steps)
            done = httpx.post(url + "/v1/completions", timeout=60, json={
                "model": "tiny-moe", "prompt": "count from 5 :", "max_tokens": 6})
            assert done.status_code == 200
        answer = asked.result()
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["worker"] == "d0" and body["steps"] == 4
    report = "\n".join(body["report"])
    assert "ms of CPU time per step" in report and "aten::" in report
    assert "by component" in report and "attention" in report
    with open(body["trace_file"]) as f:  # a Chrome / Perfetto trace
        assert json.load(f)["traceEvents"]


def test_no_traffic_ends_the_window_at_its_timeout(profiled_mesh):
    answer = httpx.post(profiled_mesh.url + "/admin/profile",
                        params={"worker": "d0", "steps": 5, "timeout": 0.5}, timeout=60)
    assert answer.status_code == 200 and answer.json()["steps"] == 0
    assert answer.json()["report"] == ["no step ran while profiling"]


def test_unknown_workers_and_bad_arguments_are_refused(profiled_mesh):
    url = profiled_mesh.url + "/admin/profile"
    missing = httpx.post(url, params={"worker": "d9"}, timeout=30)
    assert missing.status_code == 404 and "d9" in missing.json()["error"]["message"]
    assert httpx.post(url, params={"worker": "d0", "steps": 0}, timeout=30).status_code == 400
    assert httpx.post(url, params={"worker": "d0", "timeout": 1e6},
                      timeout=30).status_code == 400
    assert httpx.post(url, timeout=30).status_code == 400  # no worker named
