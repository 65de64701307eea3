"""The mesh on a local Ray instance: the Serve applications start, a streamed chat completion
goes through the gateway deployment, prefill scales from 1 to 2 replicas under queued load and
back afterwards, every request completes, and the new replica takes requests. With the SLA
planner (`evenflow up --ray --planner`), prefill scales to the size the planner sends."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import httpx
import nats
import pytest
from meshutil import wait_for

from evenflow.proto.messages import PrefillRequest, decode
from evenflow.services.launcher import free_port, start_nats, start_redis

pytestmark = pytest.mark.slow


def prefill_replicas(serve) -> int:
    status = serve.status().applications["prefill"].deployments["prefill"]
    return status.replica_states.get("RUNNING", 0)


def test_serve_app_scales_prefill_on_queued_tokens():
    ray = pytest.importorskip("ray")
    from ray import serve

    from evenflow.rayserve import app

    nats_server, redis_server = start_nats(), start_redis()
    port = free_port()
    # Least-load routing: this test is about scaling, and a KV-aware router would rightly keep
    # sending these shared-prefix prompts to the replica that has them cached.
    # worker_timeout_s 10: while Ray starts the second prefill replica (a new process loading
    # torch and the model) a 2-core CI machine can starve the decode replica's heartbeats for
    # seconds, and a gateway that then counts it dead answers 503 "no decode worker has room";
    # that is liveness detection, which this test is not about.
    args = {"nats_url": nats_server.url, "redis_url": redis_server.url, "num_ep_ranks": "0",
            "heartbeat_interval_s": "0.2", "worker_timeout_s": "10",
            "local_prefill_threshold": "0", "router": "least_load"}
    scaling = {"metrics_interval_s": 0.3, "look_back_period_s": 1.0, "upscale_delay_s": 0.5,
               "downscale_delay_s": 2.0, "num_cpus": 0.1, "target_queued_tokens": 64}
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    seen: dict[str, int] = {}
    stop = threading.Event()

    async def watch() -> None:  # which prefill workers receive requests
        nc = await nats.connect(nats_server.url)

        async def on_msg(msg) -> None:
            if isinstance(decode(msg.data), PrefillRequest):
                seen[msg.subject] = seen.get(msg.subject, 0) + 1

        await nc.subscribe("evenflow.prefill.>", cb=on_msg)
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await nc.close()

    watcher = threading.Thread(target=lambda: asyncio.run(watch()), daemon=True)
    watcher.start()
    try:
        serve.run(app.decode_app(args), name="decode", route_prefix=None, blocking=False)
        serve.run(app.kv_index_app(args), name="kv_index", route_prefix=None, blocking=False)
        serve.run(app.prefill_app({**args, **scaling, "max_replicas": 2}), name="prefill",
                  route_prefix=None, blocking=False)
        serve.run(app.gateway_app(args), name="gateway", route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        assert wait_for(lambda: _ok(url + "/health"), 180)

        with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
                "model": "tiny-moe", "stream": True, "temperature": 0, "max_tokens": 6,
                "messages": [{"role": "user", "content": "count from 5"}]}) as resp:
            lines = [x for x in resp.iter_lines() if x.startswith("data:")]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 3

        prompt = "count from 1 : " + " ".join(str(i) for i in range(1, 300))  # ~300 tokens
        results: list[int] = []

        def one(_: int) -> int:
            r = httpx.post(url + "/v1/completions", timeout=120, json={
                "model": "tiny-moe", "prompt": prompt + f" {_ % 7}", "max_tokens": 2,
                "temperature": 0})
            if r.status_code != 200:  # and which workers the gateway counted live then
                health = httpx.get(url + "/health", timeout=10).text
                print("failed:", r.status_code, r.text[:300], "health:", health)
            return r.status_code

        started = time.monotonic()
        scaled_up_at = None
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = []
            while time.monotonic() - started < 90 and (
                    scaled_up_at is None or time.monotonic() - scaled_up_at < 10):
                futures += [pool.submit(one, i) for i in range(16)]
                time.sleep(0.2)
                if scaled_up_at is None and prefill_replicas(serve) == 2:
                    scaled_up_at = time.monotonic()
            results = [f.result() for f in futures]
        assert scaled_up_at is not None, "prefill never scaled to 2 replicas"
        print(f"scaled up after {scaled_up_at - started:.1f} s")
        assert results and all(code == 200 for code in results)
        assert len(seen) >= 2 and min(seen.values()) > 0, f"requests per worker: {seen}"
        print(f"prefill requests per worker: {seen}")
        quiet = time.monotonic()
        assert wait_for(lambda: prefill_replicas(serve) == 1, 60), "never scaled back down"
        print(f"scaled back down {time.monotonic() - quiet:.1f} s after the load stopped")
        out = httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "tiny-moe", "prompt": "count from 7 :", "max_tokens": 3, "temperature": 0})
        assert out.status_code == 200
    finally:  # every step, even when one before it fails (a killed ProxyActor, say)
        stop.set()
        for cleanup in (serve.shutdown, ray.shutdown, nats_server.stop, redis_server.stop):
            try:
                cleanup()
            except Exception as exc:  # keep cleaning; the test has already failed or passed
                print(f"cleanup {cleanup.__qualname__} failed: {exc!r}")


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_the_planner_sizes_the_serve_deployments():
    pytest.importorskip("ray")
    from ray import serve

    from evenflow.rayserve.local import LocalRayMesh
    from evenflow.services.config import MeshConfig

    config = MeshConfig(host="127.0.0.1", port=free_port(), engine="mock",
                        mock_timing_scale=10.0, num_prefill=1, num_decode=1, num_ep_ranks=0,
                        local_prefill_threshold=0, planner=True, max_workers=3,
                        planner_interval_s=1.0, ttft_ms=600, itl_ms=200,
                        heartbeat_interval_s=0.2, worker_timeout_s=10, router="least_load",
                        stats_log_interval_s=0, log_level="warning")
    mesh = LocalRayMesh(config)
    try:
        mesh.start(health_timeout_s=240)
        assert "planner" in serve.status().applications

        def one(i: int) -> int:  # 400-token prompts: 0.4 s of prefill each at this scale
            return httpx.post(mesh.url + "/v1/completions", timeout=120, json={
                "model": config.model_name, "prompt": [3 + i % 400] * 400, "max_tokens": 4,
                "ignore_eos": True}).status_code

        started, scaled_up_at = time.monotonic(), None
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = []
            while time.monotonic() - started < 120 and (
                    scaled_up_at is None or time.monotonic() - scaled_up_at < 5):
                futures.append(pool.submit(one, len(futures)))
                time.sleep(0.25)  # ~4 a second: the planner wants a second prefill worker
                if scaled_up_at is None and prefill_replicas(serve) == 2:
                    scaled_up_at = time.monotonic()
            codes = [f.result() for f in futures]
        assert scaled_up_at is not None, "the planner's size never reached the deployment"
        print(f"prefill at 2 replicas after {scaled_up_at - started:.1f} s")
        # what the policy followed (test_autoscaling_policy: over the queue's own signal)
        stats = serve.get_deployment_handle("prefill", "prefill") \
            .record_autoscaling_stats.remote().result(timeout_s=30)
        assert stats.get("planner_target", 0) >= 2, stats
        assert codes and all(code == 200 for code in codes)
    finally:
        mesh.stop()
