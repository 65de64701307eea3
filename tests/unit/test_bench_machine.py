"""What every benchmark prints around its figures (bench/machine.py): a ratio of two timings in
words that say which way it goes, a warning when the host is already loaded, and temporary
files under the user's cache, removed at the end."""

from __future__ import annotations

import os

import pytest

from evenflow.bench import machine
from evenflow.bench.machine import machine_line, scratch_dir, speedup_words


def test_a_ratio_of_timings_says_faster_or_slower():
    assert speedup_words(2.0, 1.0) == "2.0x faster"
    assert speedup_words(1.0, 1.5) == "1.5x slower"
    assert speedup_words(1.0, 2.0) == "2.0x slower"  # was printed as "0.5x faster"
    assert speedup_words(1.0, 1.0) == "same speed"
    assert speedup_words(1.0, 1.04) == "same speed"  # shows as 1.0x either way
    assert speedup_words(10.0, 0.5) == "20.0x faster"
    with pytest.raises(AssertionError):
        speedup_words(1.0, 0.0)


def test_a_loaded_host_gets_a_warning_line(monkeypatch):
    monkeypatch.setattr(machine, "available_cores", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.4, 2.0, 1.0))
    lines = machine_line("float32", 2).splitlines()
    assert len(lines) == 2 and lines[0].startswith("cpu: ")
    assert lines[1] == ("WARNING: load average 3.4 exceeds 2 cores: figures will be noisy and "
                        "multi-thread runs may be far slower")
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 2.0, 1.0))
    assert len(machine_line("float32", 2).splitlines()) == 1


def test_the_load_is_measured_against_the_cores_this_process_may_use(monkeypatch):
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no affinity mask on this system")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 1.0, 1.0))
    assert machine.load_warning() is not None and "exceeds 1 core:" in machine.load_warning()


def test_temporary_files_live_in_the_user_cache_and_go_at_the_end(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with scratch_dir("serve") as path:
        assert path.parent == tmp_path / "evenflow" / "bench-tmp"
        (path / "model").mkdir()
        (path / "model" / "weights").write_bytes(b"x")
    assert not path.exists()
    with pytest.raises(KeyboardInterrupt), scratch_dir("serve") as path:
        raise KeyboardInterrupt
    assert not path.exists()


def test_every_script_defines_what_it_runs_before_running_it():
    """A module run as a script (a bench worker in another venv, a service's __main__) executes
    its `if __name__ == "__main__":` block where it stands: a function defined after it does not
    exist yet (the vLLM worker once died so, after its whole run, on its peak-RSS helper)."""
    import ast
    from pathlib import Path

    import evenflow

    late = []
    for path in Path(evenflow.__file__).parent.rglob("*.py"):
        body = ast.parse(path.read_text()).body
        mains = [i for i, node in enumerate(body) if isinstance(node, ast.If)
                 and ast.unparse(node.test).replace("'", '"') == '__name__ == "__main__"']
        if mains:
            late += [f"{path.name}: {node.name}" for node in body[mains[0] + 1:]
                     if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
    assert late == []
