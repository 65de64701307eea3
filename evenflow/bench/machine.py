"""The machine line every benchmark prints first: CPU model, the flags that decide kernel speed,
thread count and the dtype measured (figures are only comparable within one run)."""

from __future__ import annotations

import os
import platform
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


def machine_line(dtype: str, threads: int | None = None) -> str:
    model, flags = cpu_model_and_flags()
    caps = [f"{name}={os.environ[name]}" for name in ISA_CAPS if os.environ.get(name)]
    return (f"cpu: {model}; flags: {' '.join(flags) or 'none of ' + ','.join(RELEVANT_FLAGS)}; "
            f"{'kernels capped: ' + ' '.join(caps) + '; ' if caps else ''}"
            f"cores: {os.cpu_count()}; threads: {threads or 1}; dtype: {dtype}")


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
