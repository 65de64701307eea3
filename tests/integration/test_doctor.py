"""`evenflow doctor` on a local mesh: a waterfall per phase from the services' real traces, each
worker against its peers, and a verdict naming the slowest layer; and `--url` against a mesh
already running, whose services export their spans to the doctor's receiver."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest
from meshutil import running_mesh

from evenflow.ops import doctor
from evenflow.services.config import MeshConfig
from evenflow.services.launcher import free_port

pytestmark = pytest.mark.slow


def test_doctor_names_the_slowest_phase_and_compares_workers(tmp_path):
    out = tmp_path / "doctor.json"
    assert doctor.main(["--model", "tiny-moe", "--workload", "chat", "--decode", "2",
                        "--json", str(out), "--png", str(tmp_path / "w.png")]) == 0
    result = json.loads(out.read_text())
    phases = {r["phase"]: r for r in result["waterfall"]}
    for name in ("route", "prefill queue", "prefill compute", "decode, per output token",
                 "time to first token (client)"):
        assert phases[name]["p50"] is not None and phases[name]["p50"] >= 0, name
    assert result["workload"]["failed"] == 0
    workers = {(i["role"], i["worker"]) for i in result["instances"]}
    assert {("prefill", "p0"), ("decode", "d0"), ("decode", "d1")} <= workers
    assert result["verdict"].startswith("slowest layer before the first token:")
    assert (tmp_path / "w.png").read_bytes()[:4] == b"\x89PNG"


def test_doctor_reads_a_running_mesh_by_url(tmp_path):
    port = free_port()
    out = tmp_path / "doctor.json"
    with running_mesh(MeshConfig(port=0, num_prefill=1, num_decode=1, num_ep_ranks=0,
                                 local_prefill_threshold=0, stats_log_interval_s=0),
                      env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                           "OTEL_BSP_SCHEDULE_DELAY": "200"}) as mesh:
        assert doctor.main(["--url", mesh.url, "--otlp-port", str(port), "--flush-wait", "2",
                            "--workload", "chat", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["workload"]["mesh"] == mesh.url and result["workload"]["failed"] == 0
    phases = {r["phase"]: r for r in result["waterfall"]}
    assert phases["prefill compute"]["spans"] > 0 and phases["route"]["spans"] > 0
    workers = {(i["role"], i["worker"]) for i in result["instances"]}
    assert {("prefill", "p0"), ("decode", "d0")} <= workers


def test_doctor_names_the_decode_worker_a_test_slows_down(tmp_path):
    # d1 sleeps 20 ms after every step (EVENFLOW_DEBUG_STEP_DELAY_MS=d1=20): the doctor, pointed
    # at the running mesh, must name it, with its cost against its peer's
    port = free_port()
    out = tmp_path / "doctor.json"
    with running_mesh(MeshConfig(port=0, num_prefill=1, num_decode=2, num_ep_ranks=0,
                                 local_prefill_threshold=0, stats_log_interval_s=0,
                                 router="round_robin", debug_step_delay_ms="d1=20"),
                      env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                           "OTEL_BSP_SCHEDULE_DELAY": "200"}) as mesh:
        assert doctor.main(["--url", mesh.url, "--otlp-port", str(port), "--flush-wait", "2",
                            "--workload", "chat", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    decode = {i["worker"]: i for i in result["instances"] if i["role"] == "decode"}
    assert decode["d1"]["ms_per_token"] > 2 * decode["d0"]["ms_per_token"]
    assert "slowest instance: decode d1" in result["verdict"]


def test_doctor_names_the_gateway_when_streams_flood_it(tmp_path):
    # zero-compute workers (the mock engine, timing off) and a burst of 64 streams: what is
    # left of the time to first token is the gateway and its hops, and the doctor says so
    port = free_port()
    out = tmp_path / "doctor.json"
    with running_mesh(MeshConfig(port=0, engine="mock", mock_timing_scale=0.0, num_prefill=1,
                                 num_decode=2, num_ep_ranks=0, local_prefill_threshold=0,
                                 stats_log_interval_s=0, max_num_seqs=256, num_kv_blocks=8192),
                      env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                           "OTEL_BSP_SCHEDULE_DELAY": "200"}) as mesh:
        assert doctor.main(["--url", mesh.url, "--otlp-port", str(port), "--flush-wait", "2",
                            "--workload", "burst", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["workload"]["failed"] == 0
    assert result["verdict"].startswith("slowest layer before the first token: gateway")
    assert result["gateway_loop_lag_p99_ms"] is not None


def test_doctor_reports_each_expert_parallel_rank_against_its_group(tmp_path):
    # DEP workers of 2 ranks: the doctor reads the load reports every rank sends the balancer
    out = tmp_path / "doctor.json"
    assert doctor.main(["--model", "tiny-moe", "--workload", "chat", "--prefill", "1",
                        "--decode", "1", "--expert-parallel", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["workload"]["failed"] == 0
    ranks = {(r["group"].rsplit("-", 1)[-1], r["rank"]): r for r in result["ep_ranks"]}
    assert {("d0", "d0r0"), ("d0", "d0r1"), ("p0", "p0r0"), ("p0", "p0r1")} <= set(ranks)
    for rank in ranks.values():
        assert rank["steps"] > 0 and rank["moe_compute_ms"] > 0 and rank["rows_per_step"] > 0
    assert "EP rank" in result["verdict"]


def test_doctor_names_a_throttled_worker_of_a_mesh_started_without_tracing(tmp_path):
    """The mesh started plainly (no OTLP endpoint), then one decode worker throttled from
    outside (SIGSTOP / SIGCONT, 80% of the time stopped): given only the gateway's URL, the
    doctor compares workers from their heartbeats (as the gateway's /metrics re-exports them)
    and names that one, and no other, and splits the time to first token into named phases
    (the gateway's own, from its /metrics) with less than 10% left unattributed, without
    restarting anything."""
    out = tmp_path / "doctor.json"
    with running_mesh(MeshConfig(port=0, num_prefill=1, num_decode=2, num_ep_ranks=0,
                                 local_prefill_threshold=0, stats_log_interval_s=0,
                                 router="round_robin")) as mesh:
        (d1,) = [p for p in mesh.procs if str(p.args[-1]) == "d1"]
        stop = threading.Event()

        def throttle() -> None:
            while not stop.is_set():
                d1.send_signal(signal.SIGSTOP)
                time.sleep(0.06)
                d1.send_signal(signal.SIGCONT)
                time.sleep(0.015)

        thread = threading.Thread(target=throttle, daemon=True)
        thread.start()
        try:
            assert doctor.main(["--url", mesh.url, "--otlp-port", str(free_port()),
                                "--flush-wait", "0", "--workload", "chat",
                                "--json", str(out)]) == 0
        finally:
            stop.set()
            thread.join()
            d1.send_signal(signal.SIGCONT)
    result = json.loads(out.read_text())
    assert result["workload"]["failed"] == 0
    by_worker = {i["worker"]: i for i in result["instances"]}
    assert {"p0", "d0", "d1"} <= set(by_worker)
    assert all(i.get("source") == "heartbeats" for i in result["instances"])
    assert by_worker["d1"]["vs_peers"] > doctor.STANDS_OUT
    assert by_worker["d0"]["vs_peers"] < doctor.STANDS_OUT
    assert "slowest instance: decode d1" in result["verdict"]
    phases = {r["phase"]: r for r in result["waterfall"]}
    assert phases["gateway: worker compute"]["mean"] > 0
    assert phases["gateway: NATS hops"]["mean"] >= 0
    assert abs(phases["unattributed"]["share"]) < 0.10
