"""`evenflow up`'s first build of the native kernels, as the launcher runs it: its progress
(sources compiled of the total, seconds), its end, and a failure marked so that the workers
waiting for it stop waiting (the next start tries again)."""

from __future__ import annotations

import time

import pytest

from evenflow.engine.kernels import first_build, native_build


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """A build process that writes three of the sources' object files, then exits with
    the status the test sets."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(first_build, "PROGRESS_EVERY_S", 60.0)

    def with_status(code: int) -> None:
        where = native_build.build_dir()
        stems = [s.stem for s in native_build.SOURCES[:3]]
        monkeypatch.setattr(first_build, "_BUILD", (
            "import pathlib, time\n"
            f"for stem in {stems!r}:\n"
            "    time.sleep(0.5)\n"
            f"    (pathlib.Path({str(where)!r}) / (stem + '.o')).touch()\n"
            f"raise SystemExit({code})\n"))
    return with_status


def run(kernels: first_build.KernelBuild) -> None:
    deadline = time.monotonic() + 60
    while not kernels.poll():
        assert time.monotonic() < deadline, "the build never ended"
        time.sleep(0.05)


def test_the_build_tells_its_progress_and_its_end(fake_build):
    fake_build(0)
    said: list[str] = []
    kernels = first_build.KernelBuild(said.append, then="; each worker switches").start()
    run(kernels)
    total = len(native_build.SOURCES)
    assert said[0].startswith(f"building the engine's native kernels for this machine, once "
                              f"({total} sources")
    # a line per source compiled as the launcher sees them (polling: one that lands just
    # before the build ends may go unseen on a loaded machine)
    counts = [int(line.split("native kernels: ")[1].split("/")[0]) for line in said[1:-1]]
    assert counts and counts == sorted(set(counts)) and counts[-1] <= 3, said
    assert all(f"/{total} sources compiled, " in line for line in said[1:-1])
    assert said[-1].startswith("native kernels built in ") and said[-1].endswith(
        "; each worker switches")
    assert kernels.succeeded and not native_build.build_failed()


def test_a_failed_build_is_marked_for_the_waiting_workers_and_tried_again(fake_build):
    fake_build(1)
    said: list[str] = []
    run(first_build.KernelBuild(said.append).start())
    assert said[-1].startswith("native kernels unavailable after")
    assert native_build.build_failed()
    fake_build(0)
    kernels = first_build.KernelBuild(said.append).start()
    assert not native_build.build_failed()  # (the next start tries again)
    run(kernels)
