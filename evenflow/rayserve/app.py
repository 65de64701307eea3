"""Ray Serve applications: the same service classes as `evenflow up`, one deployment each.

Ray places the replicas, restarts them, health-checks them (NATS connectivity) and scales them
on their own signal (`autoscaling.py`): prefill on queued prompt tokens, decode on running
sequences and free KV blocks, the gateway on ongoing requests. Requests and KV blocks still
travel over NATS and the index stays in Redis, so a new replica takes traffic as soon as its
heartbeat reaches the gateways; a replica being removed drains first (`__del__`).

Each service is its own application (`prefill_app`, `decode_app`, ... below) so it deploys and
scales independently; `deploy/serve.yaml` lists them all.

Expert parallelism (`expert_parallel_size: N` in a prefill or decode application's args): an EP
group is co-located by being **one replica that launches its ranks**. The replica runs rank 0
in its own process and starts ranks 1..N-1 as child processes on the same node (they share a
host for the shm collectives); each rank is a mesh worker of its own, as under `evenflow up
--ep N`. The replica asks Ray for N times its CPUs, its health check fails when a rank is gone
(Ray then replaces the whole group), and children die with it (PR_SET_PDEATHSIG, and a lost
group ends every rank's collectives within seconds). Chosen over a placement group of N
STRICT_PACK bundles: Serve scales and replaces the group as one unit, with no extra actors.

Across nodes (`ep_nodes: K`): the replica asks Serve for a placement group of K bundles, one
per node (STRICT_SPREAD), each with the CPUs of N / K ranks. The replica sits in the first;
it serves the group's rendezvous store (parallel/rendezvous.py) and starts its node's other
ranks as above, and one `RankHost` actor in each other bundle starts that node's ranks. The
ranks meet through the store and form one group over the nodes (shared memory inside a node,
gloo between). A rank lost anywhere fails the replica's health check: Ray replaces the whole
group, still one unit.
"""

from __future__ import annotations

import asyncio
import importlib
import os
import signal
import subprocess
import sys
from dataclasses import replace
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

from evenflow.rayserve import autoscaling
from evenflow.services.config import MeshConfig, load_mesh_config
from evenflow.services.worker import WorkerService


def _config(args: dict[str, Any]) -> MeshConfig:
    """Application args (serve.yaml `args:`) over EVENFLOW_* variables."""
    return load_mesh_config({k: v for k, v in args.items() if k not in _DEPLOYMENT_KEYS})


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
    "planner": "evenflow.planner.service:PlannerService",
}


_ID_PREFIX = {"planner": "plan"}  # (the others: p-, d-, k-, b- and the replica's id)


class ServiceReplica:
    """Runs one WorkerService (of `role`) inside a Serve replica, on the replica's loop."""

    async def __init__(self, role: str, args: dict[str, Any]) -> None:  # type: ignore[misc]
        # (Ray Serve awaits an async constructor; Python itself would not.)
        module, _, name = SERVICES[role].partition(":")
        service_cls = getattr(importlib.import_module(module), name)
        replica = serve.get_replica_context().replica_id.unique_id
        self.role = role
        config, worker_id = _config(args), f"{_ID_PREFIX.get(role, role[0])}-{replica}"
        self.ranks: list[subprocess.Popen] = []
        self.hosts: list[Any] = []  # RankHost actors on the group's other nodes
        self._store: Any = None
        if role in ("prefill", "decode") and config.expert_parallel_size > 1:
            config = replace(config, ep_rank=0, ep_group=f"ray-{replica}")
            if config.ep_nodes > 1:
                # the group forms once every rank has come (Ray replaces it as one unit: no
                # elastic re-forming inside a replica, whose exit would end them all)
                config, self._store = _serve_rendezvous(replace(config, ep_settle_s=600.0))
                self.hosts = start_rank_hosts(role, worker_id, config)
            self.ranks = start_follower_ranks(role, worker_id, config)
            worker_id += "r0"
        self.service: WorkerService = service_cls(config, worker_id)
        self.task = asyncio.get_running_loop().create_task(
            self.service.run(install_signals=False))
        await asyncio.wait_for(self.service.started.wait(), timeout=300)

    def check_health(self) -> None:
        if self.task.done():
            raise RuntimeError(f"{self.role} service stopped: {self.task.exception()!r}")
        gone = [p.pid for p in self.ranks if p.poll() is not None]
        if self.hosts:
            import ray

            for lost in ray.get([host.exited.remote() for host in self.hosts], timeout=10):
                gone += lost
        if gone:
            raise RuntimeError(f"expert-parallel rank process(es) {gone} exited")
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
        for rank in self.ranks:
            rank.send_signal(signal.SIGTERM)
        if self.hosts:
            import ray

            for host in self.hosts:
                ray.kill(host)  # (its ranks get SIGTERM with it: PR_SET_PDEATHSIG)
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout=30)
        finally:
            for rank in self.ranks:
                try:
                    rank.wait(10)
                except subprocess.TimeoutExpired:
                    rank.kill()


def _tied_to_this_process() -> dict[str, str]:
    """A child's environment that ties it to this process: it takes SIGTERM when this process
    dies (PR_SET_PDEATHSIG, set by the child itself at its start: services/worker.py). Not a
    preexec_fn: that makes subprocess fork() this process, whose gRPC threads (Ray's) then
    abort it now and then."""
    return {"EVENFLOW_PARENT_PID": str(os.getpid())}


def start_follower_ranks(role: str, worker_id: str, config: MeshConfig,
                         ranks: range | None = None) -> list[subprocess.Popen]:
    """Ranks of this replica's DEP group as worker processes on this node: 1..N-1, or with
    the group over several nodes, this node's share after rank 0."""
    env = {**os.environ, **config.to_env(), **_tied_to_this_process()}
    if ranks is None:
        ranks = range(1, config.expert_parallel_size // max(1, config.ep_nodes))
    return [subprocess.Popen(
        [sys.executable, "-m", f"evenflow.{role}", f"{worker_id}r{rank}"],
        env={**env, "EVENFLOW_EP_RANK": str(rank)}) for rank in ranks]


def _serve_rendezvous(config: MeshConfig) -> tuple[MeshConfig, Any]:
    """The group's rendezvous store, in this replica's process, on this node's address."""
    from datetime import timedelta

    import ray
    import torch.distributed as dist

    ip = ray.util.get_node_ip_address()
    store = dist.TCPStore(ip, 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    return replace(config, ep_rendezvous=f"{ip}:{store.port}"), store


class RankHost:
    """A DEP group's ranks on one of its other nodes (a Ray actor in the group's placement
    group bundle): started as worker processes, watched, ended with the actor."""

    def __init__(self, role: str, worker_id: str, env: dict[str, str], ranks: list[int]
                 ) -> None:
        self.procs = [subprocess.Popen(
            [sys.executable, "-m", f"evenflow.{role}", f"{worker_id}r{rank}"],
            env={**os.environ, **env, **_tied_to_this_process(), "EVENFLOW_EP_RANK": str(rank)})
            for rank in ranks]

    def exited(self) -> list[int]:
        return [p.pid for p in self.procs if p.poll() is not None]


def start_rank_hosts(role: str, worker_id: str, config: MeshConfig) -> list[Any]:
    """One RankHost per other bundle of this replica's placement group (one per node)."""
    import ray
    from ray.util.placement_group import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = get_current_placement_group()
    if group is None:
        raise RuntimeError("ep_nodes > 1 needs the replica's placement group")
    per_node = config.expert_parallel_size // config.ep_nodes
    env = config.to_env()
    actor = ray.remote(RankHost)
    return [actor.options(  # type: ignore[attr-defined]
        name=f"rankhost-{worker_id}-{node}", num_cpus=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=node)).remote(
        role, worker_id, env, list(range(node * per_node, (node + 1) * per_node)))
        for node in range(1, config.ep_nodes)]


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
    cpus = float(args.get("num_cpus", 0.5)) * max(1, int(args.get("expert_parallel_size", 1)))
    nodes = int(args.get("ep_nodes", 1)) if name in ("prefill", "decode") else 1
    spread: dict[str, Any] = {}
    if nodes > 1 and int(args.get("expert_parallel_size", 1)) > 1:  # a group over K nodes
        if int(args["expert_parallel_size"]) % nodes:
            raise ValueError(f"expert_parallel_size {args['expert_parallel_size']} does not "
                             f"split over ep_nodes {nodes}")
        cpus /= nodes
        spread = {"placement_group_bundles": [{"CPU": cpus}] * nodes,
                  "placement_group_strategy": "STRICT_SPREAD"}
    deployment = serve.deployment(
        ServiceReplica, name=name, autoscaling_config=_autoscaling(args, policy, policy_kwargs),
        ray_actor_options={"num_cpus": cpus}, **spread,
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


def planner_app(args: dict[str, Any]):
    """The SLA planner, one replica. On Ray Serve run it with `planner_mode: scale`: it sends
    each role's size, and the prefill and decode deployments' policies follow it (within
    their min and max replicas); switching roles in place would move replicas between
    deployments behind Serve's back."""
    return _service_app("planner", {**args, "max_replicas": 1}, None)


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
        ray_actor_options={"num_cpus": float(args.get("num_cpus", 0.5))
                           * max(1, int(args.get("expert_parallel_size", 1)))},
        health_check_period_s=2, graceful_shutdown_timeout_s=30)
    return deployment.bind()  # type: ignore[attr-defined]  # (stubs: a Deployment)
