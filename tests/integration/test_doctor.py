"""`evenflow doctor` on a local mesh: a waterfall per phase from the services' real traces, each
worker against its peers, and a verdict naming the slowest layer."""

from __future__ import annotations

import json

import pytest

from evenflow.bench import doctor

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
