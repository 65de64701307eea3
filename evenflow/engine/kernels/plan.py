"""Which kernel a quantized weight of a given shape uses for a given number of rows: measured
once per shape, dtype and thread count on this machine (the fastest at each probe row count)
and kept in a cache file, so every process on the machine makes the same choice: the kernels
round differently, and a request that moves between two workers must continue identically."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from evenflow.engine.config.settings import cpu_description
from evenflow.engine.kernels import native

PACKED, DENSE, NATIVE = 0, 1, 2  # kernel ids in a plan


@dataclass(frozen=True)
class KernelChoice:
    """plan[i]: the kernel for up to PROBE_ROWS[i] rows (the last one beyond)."""

    plan: tuple[int, ...] = (DENSE,)
    # kernel for 0, 1, ... rows up to the last probe limit the plan covers: one index per
    # linear call on the step's hot path, not a scan of the plan
    by_rows: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        limits = PROBE_ROWS[:len(self.plan)]
        table = [self.plan[next(i for i, limit in enumerate(limits) if rows <= limit)]
                 for rows in range(limits[-1] + 1)]
        object.__setattr__(self, "by_rows", tuple(table))

    def kernel(self, rows: int) -> int:
        return self.by_rows[rows] if rows < len(self.by_rows) else self.plan[-1]

    @property
    def uses_native(self) -> bool:
        return NATIVE in self.plan


_CHOICES: dict[tuple, KernelChoice] = {}
PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64)


@functools.cache
def _choices_file(threads: int) -> Path:
    """Where this machine's measurements are kept, so every worker process on it makes the
    same choices. Keyed by CPU, torch version, threads and the native kernels' build (their
    sources: a plan measured on other kernels is measured again)."""
    from evenflow.engine.kernels import native_build

    cpu = cpu_description()  # model name and flags
    kernels = native_build.build_dir().name  # (plans made without them: named "torch-only")
    key = hashlib.sha256(f"{cpu}|{torch.__version__}|{threads}|{kernels}".encode()).hexdigest()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "evenflow"
    return cache / f"kernel-plans-{key[:16]}.json"


@functools.cache
def _stored_choices(threads: int) -> dict[str, list[int]]:
    """The file's plans, read once per process (and added to as shapes are measured)."""
    try:
        stored = json.loads(_choices_file(threads).read_text())
        return {k: [int(x) for x in v] for k, v in stored.items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def _save_choice(threads: int, key: str, plan: list[int]) -> None:
    known = _stored_choices(threads)
    known[key] = plan
    try:
        path = _choices_file(threads)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        os.replace(tmp, path)  # atomic: another process reads a whole file or the old one
    except OSError:  # a read-only home: measured again next time
        pass


def forget_choices() -> None:
    """Drop the plans this process holds (the native kernels came: they are candidates now)."""
    _CHOICES.clear()


def _time(fn, reps: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


Kernel = Callable[[Tensor], Tensor]


def native_ops(dtype: torch.dtype, k: int) -> Any | None:
    """Our kernels, if they are built and take these activations."""
    if dtype not in (torch.float32, torch.bfloat16) or k % 16:
        return None
    return native.ops()


def measured_plan(key: tuple, candidates: Callable[[], dict[int, Kernel]], k: int,
                  dtype: torch.dtype, rows: tuple[int, ...]) -> tuple[int, ...]:
    """The fastest of `candidates()` (kernel id -> function, built only when a measurement is
    needed) at each of `rows`: stored on disk for the machine, else measured now (and
    stored)."""
    name, threads = "|".join(map(str, key)), torch.get_num_threads()
    if native.ops() is None:  # (measured without them: kept apart from the plans with)
        name += "|torch-only"
    plan = _stored_choices(threads).get(name)
    if plan is None or len(plan) != len(rows):
        kernels = candidates()
        plan = []
        for m in rows:
            x = torch.randn(m, k).to(dtype)
            times = {kid: _time(lambda x=x, fn=fn: fn(x)) for kid, fn in kernels.items()}
            plan.append(min(times, key=lambda kid: times[kid]))
        _save_choice(threads, name, plan)
    return tuple(plan)


def choose(key: tuple, candidates: Callable[[], dict[int, Kernel]], k: int,
           dtype: torch.dtype, rows: tuple[int, ...]) -> KernelChoice:
    """The plan for `key`: remembered, stored on disk, or measured (measured_plan)."""
    if key not in _CHOICES:
        _CHOICES[key] = KernelChoice(measured_plan(key, candidates, k, dtype, rows))
    return _CHOICES[key]


# A quantized panel's two ways for a block of rows (engine/kernels/panel_run.h run_panel):
# read the stored codes directly (float rows, or rows quantized to int8 where the form meets
# int8 rows: w8a8, and int4 / MXFP4 / 5-bit codes in the VNNI layout), or dequantize the panel
# once into a plain one for the dot-product kernel. The probes reach prefill's rows (an expert
# of a 2,048-token chunk sees ~512 of them).
PANEL_PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512)
ROWS_DIRECT, ROWS_DEQUANT = 3, 4
NEVER_DEQUANT = 0x7FFF  # (the largest dequant_from the kernels' group word holds)


def dequant_from(plan: tuple[int, ...], rows: tuple[int, ...] = PANEL_PROBE_ROWS) -> int:
    """The row count from which a panel plan (a way per probe row count) dequantizes: from
    the probe after which every probe chose to dequantize (an odd probe between: read
    directly); NEVER_DEQUANT where the last probe read the codes directly."""
    if not plan or plan[-1] != ROWS_DEQUANT:
        return NEVER_DEQUANT
    i = len(plan) - 1
    while i > 0 and plan[i - 1] == ROWS_DEQUANT:
        i -= 1
    return 1 if i == 0 else rows[i - 1] + 1
