"""Where the native kernels are built, and the lock that makes one process build them while the
others wait (torch-free: `evenflow up` asks whether a build is due before it starts workers).

A build is kept per source path and text, torch version, CPU flags and -march, in
~/.cache/evenflow/kernels/<key>: a copy built for another machine (a shared home, a container
image) is never loaded on one lacking its instructions.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import os
from collections.abc import Iterator
from pathlib import Path

from evenflow.engine.config.settings import cpu_description, engine_switch

HERE = Path(__file__).parent
# every C++ file here, in a fixed order (the build key hashes them all: a header edited
# rebuilds too)
SOURCES = tuple(sorted(HERE.glob("*.cpp")))
HEADERS = tuple(sorted(HERE.glob("*.h")))
LIBRARY = "evenflow_kernels"
# What a first build costs, for the line `evenflow up` prints (measured on 2 cores).
TYPICAL_BUILD_S = 90


def march() -> str:
    """The -march the kernels are built for: this CPU's, unless EVENFLOW_NATIVE_MARCH says."""
    return engine_switch("EVENFLOW_NATIVE_MARCH")


def build_dir() -> Path:
    digest = hashlib.sha256()
    # (the path too: two checkouts must not rebuild each other's copy)
    for source in SOURCES + HEADERS:
        digest.update(str(source.resolve()).encode() + source.read_bytes())
    torch_version = importlib.metadata.version("torch")
    digest.update(f"{torch_version}|{cpu_description()}|{march()}".encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "evenflow" / "kernels" / digest.hexdigest()[:16]


def is_built() -> bool:
    """Whether this machine holds a finished build of the current sources (one that loaded:
    `mark_ready`; a library file alone may be a link still being written)."""
    return (build_dir() / READY).is_file()


READY = "evenflow-ready"  # written once a build has loaded
FAILED = "evenflow-failed"  # written when a background build gave up (the next start retries)


def build_failed() -> bool:
    """Whether the last background build of the current sources failed here."""
    return (build_dir() / FAILED).is_file()


def mark_ready(where: Path) -> None:
    (where / READY).touch()


def objects_done(where: Path) -> int:
    """How many of the sources a build in progress has compiled (their object files)."""
    stems = {source.stem for source in SOURCES}
    return sum(1 for obj in where.glob("*.o") if obj.stem in stems)


@contextlib.contextmanager
def build_lock(where: Path) -> Iterator[bool]:
    """Held while one process builds or loads the kernels in `where`; yields whether this
    process had to wait for another (then the build is there when the lock comes)."""
    where.mkdir(parents=True, exist_ok=True)
    with open(where / "evenflow-build.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            waited = False
        except BlockingIOError:
            fcntl.flock(lock, fcntl.LOCK_EX)
            waited = True
        try:
            yield waited
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
