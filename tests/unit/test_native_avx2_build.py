"""The native kernels also build for CPUs without AVX-512 (-march=haswell: AVX2 + FMA), and
there they compute what torch computes. An AVX-512 intrinsic outside its `#if` breaks that build
(it happened once: prefill_attention.cpp's AMX path), and an AVX2 machine's users then get
torch's kernels everywhere, with one log line to say so. Built into a private cache here, so
this machine's own build is untouched."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from evenflow.engine.kernels import native

HERE = Path(__file__).parent
# kernel tests whose native results are compared with torch's (the AVX2 code paths of each)
PAIRS = ["test_mla_decode.py", "test_fused_kernels.py", "test_panel_kernels.py"]


@pytest.mark.slow
def test_kernels_build_for_avx2_and_match_torch(tmp_path):
    if shutil.which("c++") is None or not native.enabled():
        pytest.skip("no C++ compiler (or EVENFLOW_NATIVE_KERNELS=0): torch's kernels serve")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "EVENFLOW_NATIVE_MARCH": "haswell",
           "EVENFLOW_NATIVE_BUILD": "wait"}
    built = subprocess.run(
        [sys.executable, "-c", "from evenflow.engine.kernels import native; native.ops(); "
         "print(native.summary())"], env=env, capture_output=True, text=True, timeout=900)
    summary = built.stdout.strip().splitlines()[-1] if built.stdout.strip() else built.stderr
    assert summary.startswith("native kernels (-march=haswell)"), summary
    assert "torch's" not in summary, summary  # every kernel native, none fallen back
    checked = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         *(str(HERE / name) for name in PAIRS)],
        env=env, capture_output=True, text=True, timeout=900, cwd=HERE.parent.parent)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-2000:]
