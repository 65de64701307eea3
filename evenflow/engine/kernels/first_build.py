"""The native kernels' first build, as `evenflow up` runs it: in a process of its own at low
priority, with its progress told (sources compiled of the total, seconds so far).

By default the mesh starts at once on torch's kernels while this builds (the workers get
EVENFLOW_NATIVE_BUILD=background and switch when it is done: engine/kernels/native.py); modes
whose workers must all run the same kernels from the first step (deterministic, tensor or
expert parallel, Ray Serve) wait for it first, still showing the progress. Torch-free: the
launcher imports this before any worker exists.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from evenflow.engine.config.settings import switched_on
from evenflow.engine.kernels import native_build

# Runs the build (the same call a worker makes) at a lower priority than the serving workers,
# so the first requests are not slowed by the compiler on a small machine.
_BUILD = ("import os; os.nice(10); from evenflow.engine.kernels import native; "
          "raise SystemExit(native.ops() is None)")
PROGRESS_EVERY_S = 15.0  # a progress line at least this often, and at each source compiled


def due() -> bool:
    """Whether this machine still needs the build (native kernels on, no finished build)."""
    return switched_on("EVENFLOW_NATIVE_KERNELS") and not native_build.is_built()


@dataclass
class KernelBuild:
    """One build process; `poll()` reports progress lines and says when it is over."""

    say: Callable[[str], None]
    then: str = ""  # what happens next, for the line that says it is built
    started: float = field(default_factory=time.monotonic)
    proc: subprocess.Popen | None = None
    succeeded: bool | None = None  # None while it runs
    _done_seen: int = -1
    _said_at: float = 0.0

    def start(self) -> KernelBuild:
        sources, typical_s = len(native_build.SOURCES), native_build.TYPICAL_BUILD_S
        self.say(f"building the engine's native kernels for this machine, once "
                 f"({sources} sources, ~{typical_s} s on 2 cores; later starts reuse them)")
        where = native_build.build_dir()
        where.mkdir(parents=True, exist_ok=True)
        (where / native_build.FAILED).unlink(missing_ok=True)  # (a failure before: tried again)
        self.proc = subprocess.Popen([sys.executable, "-c", _BUILD],
                                     env={**os.environ, "EVENFLOW_NATIVE_BUILD": "wait"},
                                     start_new_session=True)
        return self

    def poll(self) -> bool:
        """Report progress; True once the build is over (succeeded says how)."""
        if self.succeeded is not None:
            return True
        assert self.proc is not None, "start() first"
        code = self.proc.poll()
        elapsed = time.monotonic() - self.started
        if code is not None:
            self.succeeded = code == 0
            if not self.succeeded:  # the waiting workers stop waiting: torch's kernels stay
                (native_build.build_dir() / native_build.FAILED).touch()
            self.say(f"native kernels built in {elapsed:.0f} s{self.then}" if self.succeeded
                     else f"native kernels unavailable after {elapsed:.0f} s: torch's kernels "
                     "serve")
            return True
        done = native_build.objects_done(native_build.build_dir())
        if done != self._done_seen or elapsed - self._said_at >= PROGRESS_EVERY_S:
            if self._done_seen >= 0 or done:
                self.say(f"native kernels: {done}/{len(native_build.SOURCES)} sources compiled, "
                         f"{elapsed:.0f} s")
            self._done_seen, self._said_at = done, elapsed
        return False

    def wait(self, every_s: float = 1.0) -> bool:
        """Block until the build is over, reporting progress; whether it succeeded."""
        while not self.poll():
            time.sleep(every_s)
        return bool(self.succeeded)

    def stop(self) -> None:
        """Abandon the build (the mesh is stopping), compilers included (its session's
        process group): the next start builds again."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for signum, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
            try:
                os.killpg(self.proc.pid, signum)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue
