"""Requests to a mesh on simulated hosts, sent from a host (only hosts reach each other's
addresses)."""

from __future__ import annotations

import json
import sys
import time

PROMPT = "count from 7 :"


def complete(host, url: str, timeout_s: float = 60, prompt: str = PROMPT,
             max_tokens: int = 3) -> tuple[int | str, str]:
    """A streamed completion sent from `host` (only hosts reach each other's addresses):
    (HTTP status, or the error event's code when the stream ended in one; the streamed
    text); (0, stderr) where the client itself failed."""
    script = (
        "import httpx, json, sys\n"
        "text, status = '', 0\n"
        f"with httpx.stream('POST', '{url}/v1/completions', timeout={timeout_s}, json="
        f"{{'model': 'tiny-moe', 'prompt': {prompt!r}, 'max_tokens': {max_tokens}, "
        "'temperature': 0,"
        " 'stream': True}) as r:\n"
        "    status = r.status_code\n"
        "    for line in r.iter_lines():\n"
        "        if line.startswith('data: {'):\n"
        "            event = json.loads(line[6:])\n"
        "            if 'error' in event:\n"
        "                status = event['error'].get('code') or 'error'\n"
        "                break\n"
        "            text += event['choices'][0]['text']\n"
        "print(json.dumps([status, text]))\n")
    done = host.run([sys.executable, "-c", script], timeout=timeout_s + 10)
    if done.returncode:
        return 0, done.stderr[-300:]
    status, text = json.loads(done.stdout.strip().splitlines()[-1])
    return status, text


def until_served(host, url: str, within_s: float, poll_s: float = 1.0, **request) -> str:
    deadline = time.monotonic() + within_s
    last = (0, "")
    while time.monotonic() < deadline:
        last = complete(host, url, timeout_s=20, **request)
        if last[0] == 200 and last[1].split():
            return last[1]
        time.sleep(poll_s)
    raise AssertionError(f"not served within {within_s} s: {last}")


def health(host, url: str) -> dict:
    """The gateway's /health body ({} where it does not answer)."""
    script = (f"import httpx; print(httpx.get('{url}/health', timeout=5).text)")
    done = host.run([sys.executable, "-c", script], timeout=15)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {}
