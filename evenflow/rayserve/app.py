"""Ray Serve applications: the same service classes as `evenflow up`, one deployment each.

Ray places the replicas, restarts them, health-checks them (NATS connectivity) and scales them
on their own signal (`autoscaling.py`): prefill on queued prompt tokens, decode on running
sequences and free KV blocks, the gateway on ongoing requests. Requests and KV blocks still
travel over NATS and the index stays in Redis, so a new replica takes traffic as soon as its
heartbeat reaches the gateways; a replica being removed drains first (`__del__`).

Each service is its own application (`prefill_app`, `decode_app`, ... below) so it deploys and
scales independently; `deploy/serve.yaml` lists them all.
"""

from __future__ import annotations

import asyncio
import importlib
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

from evenflow.rayserve import autoscaling
from evenflow.services.config import MeshConfig, load_config
from evenflow.services.worker import WorkerService


def _config(args: dict[str, Any]) -> MeshConfig:
    """Application args (serve.yaml `args:`) over EVENFLOW_* variables."""
    return load_config({k: v for k, v in args.items() if k not in _DEPLOYMENT_KEYS})


# Application args that configure the deployment rather than the mesh.
_DEPLOYMENT_KEYS = {"min_replicas", "max_replicas", "initial_replicas", "upscale_delay_s",
                    "downscale_delay_s", "metrics_interval_s", "look_back_period_s",
                    "target_ongoing_requests", "num_cpus", "target_queued_tokens",
                    "target_running"}


# The service class each application runs, by role.
SERVICES = {
    "prefill": "evenflow.prefill.service:PrefillWorker",
    "decode": "evenflow.decode.service:DecodeWorker",
    "kv_index": "evenflow.kv_index.service:KVIndexService",
    "balancer": "evenflow.balancer.service:BalancerService",
}


class ServiceReplica:
    """Runs one WorkerService (of `role`) inside a Serve replica, on the replica's loop."""

    async def __init__(self, role: str, args: dict[str, Any]) -> None:  # type: ignore[misc]
        # (Ray Serve awaits an async constructor; Python itself would not.)
        module, _, name = SERVICES[role].partition(":")
        service_cls = getattr(importlib.import_module(module), name)
        replica = serve.get_replica_context().replica_id.unique_id
        self.role = role
        self.service: WorkerService = service_cls(_config(args), f"{role[0]}-{replica}")
        self.task = asyncio.get_running_loop().create_task(
            self.service.run(install_signals=False))
        await asyncio.wait_for(self.service.started.wait(), timeout=300)

    def check_health(self) -> None:
        if self.task.done():
            raise RuntimeError(f"{self.role} service stopped: {self.task.exception()!r}")
        if not self.service.bus.connected:
            raise RuntimeError("not connected to NATS")
        problem = self.service.healthy()
        if problem:
            raise RuntimeError(problem)

    def record_autoscaling_stats(self) -> dict[str, float]:
        return self.service.autoscaling_stats()

    async def __del__(self) -> None:
        """Scale-down or shutdown: stop taking work, finish in-flight requests, leave."""
        self.service.request_stop()
        await asyncio.wait_for(asyncio.shield(self.task), timeout=30)


def _autoscaling(args: dict[str, Any], policy: str | None,
                 policy_kwargs: dict[str, Any] | None = None) -> AutoscalingConfig:
    extra: dict[str, Any] = {"policy": AutoscalingPolicy(
        policy_function=policy, policy_kwargs=policy_kwargs or {})} if policy else {}
    return AutoscalingConfig(
        min_replicas=int(args.get("min_replicas", 1)),
        max_replicas=int(args.get("max_replicas", 1)),
        initial_replicas=int(args.get("initial_replicas", args.get("min_replicas", 1))),
        metrics_interval_s=float(args.get("metrics_interval_s", 2.0)),
        look_back_period_s=float(args.get("look_back_period_s", 4.0)),
        upscale_delay_s=float(args.get("upscale_delay_s", 2.0)),
        downscale_delay_s=float(args.get("downscale_delay_s", 10.0)),
        target_ongoing_requests=float(args.get("target_ongoing_requests",
                                               autoscaling.TARGET_ONGOING_REQUESTS)),
        **extra)


def _service_app(name: str, args: dict[str, Any], policy: str | None,
                 policy_kwargs: dict[str, Any] | None = None):
    deployment = serve.deployment(
        ServiceReplica, name=name, autoscaling_config=_autoscaling(args, policy, policy_kwargs),
        ray_actor_options={"num_cpus": float(args.get("num_cpus", 0.5))},
        health_check_period_s=2, health_check_timeout_s=10, graceful_shutdown_timeout_s=30,
        max_ongoing_requests=1)
    return deployment.bind(name, args)  # type: ignore[attr-defined]  # (stubs: a Deployment)


def prefill_app(args: dict[str, Any]):
    """Scales on queued prompt tokens (arg `target_queued_tokens`, default 2,048 per replica)."""
    return _service_app("prefill", args,
                        "evenflow.rayserve.autoscaling:PrefillPolicy",
                        {"target_queued_tokens": float(args.get("target_queued_tokens",
                                                                autoscaling.TARGET_QUEUED_TOKENS))})


def decode_app(args: dict[str, Any]):
    """Scales on running sequences (arg `target_running`, default 32 per replica) and on free
    KV blocks (below 20% free: one more)."""
    return _service_app("decode", args,
                        "evenflow.rayserve.autoscaling:DecodePolicy",
                        {"target_running": float(args.get("target_running",
                                                          autoscaling.TARGET_RUNNING))})


def kv_index_app(args: dict[str, Any]):
    return _service_app("kv_index", {**args, "max_replicas": 1}, None)


def balancer_app(args: dict[str, Any]):
    return _service_app("balancer", {**args, "max_replicas": 1}, None)


def gateway_app(args: dict[str, Any]):
    """The HTTP ingress: the FastAPI app of `evenflow.gateway`, scaled on ongoing requests."""
    from evenflow.gateway.app import create_app

    config = _config(args)
    fastapi_app = create_app(config)

    @serve.ingress(fastapi_app)
    class Gateway:
        def check_health(self) -> None:
            gateway = fastapi_app.state.gateway
            if gateway is not None and not gateway.client.bus.connected:
                raise RuntimeError("gateway lost NATS")

    deployment = serve.deployment(
        Gateway, name="gateway", autoscaling_config=_autoscaling(args, None),
        ray_actor_options={"num_cpus": float(args.get("num_cpus", 0.5))},
        health_check_period_s=2, graceful_shutdown_timeout_s=30)
    return deployment.bind()  # type: ignore[attr-defined]  # (stubs: a Deployment)
