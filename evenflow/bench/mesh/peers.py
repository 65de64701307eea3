"""Peers' servers that `evenflow bench frontend` starts beside evenflow's mesh, from their own
venvs, on the same load generator: vLLM's OpenAI server over its CPU build, and Dynamo's
frontend over its mocker (zero-compute workers, as evenflow's mock engine).

Each is a `PeerServer`: its OpenAI base URL, its model name, and its processes by role, whose
CPU time the bench reads per streamed token (as it does for evenflow's processes).

- vLLM (`--vllm-python PATH`: the Python of a venv with vLLM's CPU build; README "Benchmarks"):
  `vllm.entrypoints.openai.api_server` serving tiny-moe in bf16. Roles: "api server" (HTTP,
  tokenizing, detokenizing: what evenflow's gateway does) and "engine core" (its scheduler and
  the model's compute: no zero-compute mode).
- Dynamo (`--dynamo-python PATH`: a venv with the ai-dynamo and ai-dynamo-runtime wheels,
  installed with --no-deps, and the few modules its frontend imports: README "Benchmarks"):
  `dynamo.frontend` and `dynamo.mocker` (one worker) with file-based discovery in a temporary
  directory, its KV block size matching evenflow's, on the benchmark model's tokenizer (the
  mocker's token ids decode to nothing in tiny-moe's small vocabulary). Roles: "frontend" and
  "mocker".
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from evenflow.services.launcher import free_port


class PeerError(RuntimeError):
    """A peer that would not start: the message says why (its log's last lines)."""


@dataclass
class PeerServer:
    name: str
    url: str
    model: str
    procs: dict[str, subprocess.Popen]
    logs: list[Path] = field(default_factory=list)
    workdir: str | None = None
    # role -> the role its process's descendants count as (vLLM: the engine core is the api
    # server's child); other roles count their descendants as themselves
    children_as: dict[str, str] = field(default_factory=dict)

    def cpu_by_role(self) -> dict[str, float]:
        """CPU seconds so far by role."""
        import psutil

        def seconds(procs: list[psutil.Process]) -> float:
            total = 0.0
            for proc in procs:
                try:
                    times = proc.cpu_times()
                except psutil.Error:  # gone
                    continue
                total += times.user + times.system
            return total

        used: dict[str, float] = {}
        for role, proc in self.procs.items():
            try:
                root = psutil.Process(proc.pid)
                children = root.children(recursive=True)
            except psutil.Error:
                continue
            if role in self.children_as:
                used[role] = seconds([root])
                used[self.children_as[role]] = seconds(children)
            else:
                used[role] = seconds([root, *children])
        return used

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _wait_ready(server: PeerServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for role, proc in server.procs.items():
            if proc.poll() is not None:
                server.stop()
                raise PeerError(f"{server.name} {role} exited ({proc.returncode}): "
                                + _tail(server.logs))
        try:
            models = httpx.get(server.url + "/v1/models", timeout=2).json().get("data") or []
            if models:
                server.model = models[0]["id"]
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1.0)
    server.stop()
    raise PeerError(f"{server.name} not serving within {timeout_s:g} s: " + _tail(server.logs))


def _tail(logs: list[Path]) -> str:
    lines = []
    for log in logs:
        try:
            text = log.read_text(errors="replace").strip().splitlines()
        except OSError:
            continue
        errors = [line for line in text if "Error" in line or "error" in line]
        lines.append((errors or text or ["(empty log)"])[-1][:400])
    return " | ".join(lines)


def _spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=str(log.parent), start_new_session=True)


def start_vllm(python: str, model_dir: str, threads: int, timeout_s: float = 300) -> PeerServer:
    """vLLM's OpenAI server on `model_dir` (bf16, 512 positions)."""
    workdir = tempfile.mkdtemp(prefix="evenflow-vllm-")
    port = free_port()
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
               VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS=str(threads))
    env.pop("PYTHONPATH", None)  # (its venv, not evenflow's tree)
    log = Path(workdir) / "vllm.log"
    proc = _spawn([python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                   "--served-model-name", "tiny-moe", "--dtype", "bfloat16", "--port",
                   str(port), "--max-model-len", "512", "--gpu-memory-utilization", "0.3"],
                  log, env)
    server = PeerServer("vLLM", f"http://127.0.0.1:{port}", "tiny-moe", {"api server": proc},
                        [log], workdir, children_as={"api server": "engine core"})
    _wait_ready(server, timeout_s)
    return server


def start_dynamo(python: str, model_dir: str, block_size: int, timeout_s: float = 180,
                 router: str = "kv") -> PeerServer:
    """Dynamo's frontend and one mocker worker on `model_dir`'s tokenizer and config; its
    router in `router` mode (kv: KV-aware from the mocker's KV events over ZMQ, as evenflow's
    router works; round-robin: none of that work)."""
    workdir = tempfile.mkdtemp(prefix="evenflow-dynamo-")
    port = free_port()
    env = dict(os.environ, DYN_FILE_KV=str(Path(workdir) / "kv"), DYN_LOG="warn")
    env.pop("PYTHONPATH", None)
    logs = [Path(workdir) / "frontend.log", Path(workdir) / "mocker.log"]
    frontend = _spawn([python, "-m", "dynamo.frontend", "--http-port", str(port),
                       "--discovery-backend", "file", "--router-mode", router,
                       "--kv-cache-block-size", str(block_size)], logs[0], env)
    mocker = _spawn([python, "-m", "dynamo.mocker", "--model-path", model_dir,
                     "--discovery-backend", "file", "--block-size", str(block_size),
                     "--speedup-ratio", "1000000"], logs[1], env)
    server = PeerServer("Dynamo", f"http://127.0.0.1:{port}", "tiny-moe",
                        {"frontend": frontend, "mocker": mocker}, logs, workdir)
    _wait_ready(server, timeout_s)
    return server
