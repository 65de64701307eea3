"""`evenflow up --model DIR` on the families whose attention or experts differ most from the
default model — DeepSeek-V3 (MLA: the prefill worker hands the decode worker its latent cache)
and GPT-OSS (sinks, sliding windows, biased experts): a greedy chat completion is the offline
engine's greedy text for the same messages."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from checkpoints import make_checkpoint

from evenflow import LLM, SamplingParams

pytestmark = pytest.mark.slow  # a mesh per family: ~30 s each

MESSAGES = [{"role": "user", "content": "w17 w41 w99 w5 w230 w64 w12 w7 w180 w33"}]


def served_url(proc: subprocess.Popen, timeout_s: float = 180) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line and proc.poll() is not None:
            break
        if match := re.search(r"at (http://\S+)", line):
            return match.group(1)
    raise AssertionError("evenflow up printed no URL")


@pytest.mark.parametrize("arch", ["deepseek_v3", "gpt_oss"])
def test_up_serves_the_family_as_the_offline_engine_does(arch, tmp_path):
    make_checkpoint(arch, tmp_path / arch)
    model = str(tmp_path / arch)
    offline = LLM(model, dtype="float32").chat(
        MESSAGES, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    log = (tmp_path / "stderr").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "evenflow.cli", "up", "--port", "0",
                             "--model", model, "--dtype", "float32"],
                            stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        url = served_url(proc)
        served = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        reply = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": served, "messages": MESSAGES, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == offline.text
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        log.close()
