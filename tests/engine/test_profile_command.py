"""`evenflow profile`: the operator table for a prefill step and N decode steps of the offline
engine, with per-component shares (the sampler's included), and a trace Perfetto can load."""

from __future__ import annotations

import json

from evenflow.bench.offline import profile_bench


def test_profile_prints_both_phases_and_writes_a_chrome_trace(tmp_path, capsys):
    trace = tmp_path / "decode.json"
    assert profile_bench.main(["--model", "tiny-moe", "--batch", "2", "--prompt-len", "24",
                               "--steps", "3", "--threads", "1", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "prefill:" in out and "decode:" in out and "(3 step(s))" in out
    assert "attention" in out and "sampler" in out and "aten::" in out
    assert json.loads(trace.read_text())["traceEvents"]
