"""The machine line every benchmark prints first: CPU model, the flags that decide kernel speed,
thread count and the dtype measured (figures are only comparable within one run), with a warning
when the host is already busy; the words for how two timings compare; and where a benchmark
keeps its temporary files."""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Environment variables that hold oneDNN / MKL / ATen below the CPU's instruction set (an
# AVX2 machine's kernels on an AVX-512 one)
ISA_CAPS = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY",
            "EVENFLOW_NATIVE_MARCH")  # (the last: our own kernels', engine/kernels/native.py)
RELEVANT_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8", "avx512_vnni",
                  "avx_vnni")


def cpu_model_and_flags() -> tuple[str, list[str]]:
    model, flags = platform.processor() or "unknown", set[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    return model, [f for f in RELEVANT_FLAGS if f in flags]


def available_cores() -> int:
    """The cores this process may run on (its affinity mask; a container's share), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not on Linux)
        return os.cpu_count() or 1


def load_warning() -> str | None:
    """A warning when the 1-minute load average exceeds the cores available: other processes
    hold the CPUs, so timings are noisy, and a run with several threads waits for cores that
    are busy (on a shared 2-core host, --threads 2 measured 8-70x slower than --threads 1)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # (no load average on this system)
        return None
    cores = available_cores()
    if load <= cores:
        return None
    return (f"WARNING: load average {load:.1f} exceeds {cores} core{'s' if cores > 1 else ''}: "
            "figures will be noisy and multi-thread runs may be far slower")


def machine_line(dtype: str, threads: int | None = None) -> str:
    """The machine line, and on a busy host a second line: load_warning()."""
    model, flags = cpu_model_and_flags()
    caps = [f"{name}={os.environ[name]}" for name in ISA_CAPS if os.environ.get(name)]
    line = (f"cpu: {model}; flags: {' '.join(flags) or 'none of ' + ','.join(RELEVANT_FLAGS)}; "
            f"{'kernels capped: ' + ' '.join(caps) + '; ' if caps else ''}"
            f"cores: {os.cpu_count()}; threads: {threads or 1}; dtype: {dtype}")
    warning = load_warning()
    return line if warning is None else f"{line}\n{warning}"


def speedup_words(baseline_s: float, new_s: float) -> str:
    """How a new time compares with a baseline time (seconds, or any one unit; lower is
    better): "2.0x faster", "1.5x slower", or "same speed" when the ratio shows as 1.0x."""
    assert baseline_s > 0 and new_s > 0, (baseline_s, new_s)
    ratio = baseline_s / new_s
    shown = f"{max(ratio, 1 / ratio):.1f}"
    if shown == "1.0":
        return "same speed"
    return f"{shown}x faster" if ratio > 1 else f"{shown}x slower"


def bench_tmp_dir() -> Path:
    """The benchmarks' temporary files live here, under the user's cache
    ($XDG_CACHE_HOME or ~/.cache), not in the system temp dir that other users share."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = cache / "evenflow" / "bench-tmp"
    path.mkdir(parents=True, exist_ok=True)
    return path


def bench_checkpoints() -> Path:
    """Where the benchmarks keep the random checkpoints they reuse from run to run (each
    written once per shape): the user's cache, beside bench_tmp_dir()."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "evenflow" / "bench-checkpoints"


@contextmanager
def scratch_dir(prefix: str) -> Iterator[Path]:
    """A directory of one run's own under bench_tmp_dir(), removed with all it holds at the
    end (an error or Ctrl-C included)."""
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=bench_tmp_dir()))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def peak_rss_mb() -> float:
    """This process's peak resident memory, MB: Linux's VmHWM, which belongs to the process's
    own address space (getrusage's ru_maxrss is inherited across fork and exec, so a worker
    started by a bench that had grown reported the bench's peak instead of its own)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> None:
    """Start VmHWM again from the current RSS (Linux: clear_refs 5), where the kernel allows."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def run_worker(module: str, args: list[str], threads: int, label: str,
               env: dict[str, str] | None = None, command: list[str] | None = None
               ) -> dict | None:
    """`python -m module --worker args...` (or `command` + args) in its own process (its own
    peak RSS, the same thread count): the JSON object on its last stdout line, or None
    (stderr's tail printed)."""
    import json
    import subprocess
    import sys

    cmd = [*(command or [sys.executable, "-m", module, "--worker"]), *args]
    run_env = dict(os.environ, OMP_NUM_THREADS=str(threads), **(env or {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=run_env)
    if proc.returncode != 0:
        print(f"[{label}] failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])
