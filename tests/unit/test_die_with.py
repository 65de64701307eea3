"""A worker started with EVENFLOW_PARENT_PID (a Ray Serve replica's DEP ranks: no preexec_fn,
whose fork() a process with gRPC threads does not survive) ties itself to that process at its
start: it ends when the process ends, and at once when the process is gone already."""

from __future__ import annotations

import subprocess
import sys
import time

TIED = ("import os, sys, time\n"
        "from evenflow.services.launcher import die_with\n"
        "die_with(int(sys.argv[1]))\n"
        "print('tied', flush=True)\n"
        "time.sleep(60)\n")


def test_a_child_tied_to_a_gone_process_ends_at_once():
    out = subprocess.run([sys.executable, "-c", TIED, "1"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "is gone" in out.stderr


def test_a_tied_child_ends_with_its_parent():
    # the middle process starts the tied child, reports its pid and exits at once
    middle = ("import subprocess, sys, os, time\n"
              f"child = subprocess.Popen([sys.executable, '-c', {TIED!r}, str(os.getpid())],\n"
              "                         stdout=subprocess.PIPE, text=True)\n"
              "assert child.stdout.readline().strip() == 'tied'\n"
              "print(child.pid, flush=True)\n")
    out = subprocess.run([sys.executable, "-c", middle], capture_output=True, text=True,
                         timeout=60)
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        subprocess.run(["kill", "-9", str(pid)])
        raise AssertionError("the tied child outlived its parent")
