"""`evenflow up --ray`: the mesh as Ray Serve applications on a local Ray instance, with
nats-server and redis-server started on free ports unless URLs are configured. The NATS it
starts has a user per service role (replica ids are not known in advance: see
services/nats_auth.py); each application gets its role's credentials file."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from evenflow.services import nats_auth
from evenflow.services.config import MeshConfig
from evenflow.services.launcher import (
    LocalServer,
    ensure_data_plane,
    free_port,
    start_nats,
    wait_for_health,
)


class LocalRayMesh:
    def __init__(self, config: MeshConfig, address: str | None = None) -> None:
        """address: an existing Ray cluster's (`ray start --head` on one host, `ray start
        --address` on the others): the applications are deployed there, spread over its
        nodes, and NATS and Redis must be given (URLs every node reaches)."""
        self.config = config
        self.address = address
        self.servers: list[LocalServer] = []
        self.credentials: dict[str, str] = {}  # role -> credentials file
        self._secrets: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def start(self, health_timeout_s: float = 300) -> None:
        import ray
        from ray import serve
        from ray.serve.api import RunTarget, run_many

        from evenflow.rayserve import app

        cfg = self.config
        if self.address and not (cfg.nats_url and cfg.redis_url):
            from evenflow.services.launcher import LaunchError

            raise LaunchError("a Ray cluster's mesh needs NATS and Redis every node reaches "
                              "(--nats-url, --redis-url)")
        if not cfg.nats_url and cfg.nats_auth:
            cfg = self._start_secure_nats(cfg)
        cfg = self.config = ensure_data_plane(cfg, self.servers)
        args: dict[str, Any] = {k.removeprefix("EVENFLOW_").lower(): v
                                for k, v in cfg.to_env().items()}
        # Logical CPUs, not cores: the services mostly wait on the network, and each replica
        # asks for a quarter; a small machine still fits the whole mesh.
        if self.address:  # a cluster: its nodes' CPUs as they were started
            ray.init(address=self.address, ignore_reinit_error=True)
        else:
            ray.init(num_cpus=max(8, os.cpu_count() or 1), include_dashboard=False,
                     ignore_reinit_error=True)
        # on a cluster, the HTTP proxy where the gateway's address is (the head), unless it
        # binds every address (then one on every node)
        everywhere = not self.address or cfg.host in ("0.0.0.0", "::")
        serve.start(http_options={"host": cfg.host, "port": cfg.port},
                    proxy_location="EveryNode" if everywhere else "HeadOnly")
        args = {**args, "num_cpus": 0.25}

        def of(role: str, **extra: Any) -> dict[str, Any]:
            creds = self.credentials.get(role)
            return {**args, **extra, **({"nats_credentials_file": creds} if creds else {})}

        # every application at once (run_many), not one after another: each engine replica's
        # start (imports, the model, a DEP group's rank actors) takes long on a busy machine
        targets = [RunTarget(app.decode_app(of("decode", max_replicas=4,
                                                min_replicas=cfg.num_decode)),
                             name="decode", route_prefix=None)]
        if cfg.num_prefill:
            targets.append(RunTarget(app.prefill_app(of("prefill", max_replicas=4,
                                                        min_replicas=cfg.num_prefill)),
                                     name="prefill", route_prefix=None))
        targets.append(RunTarget(app.kv_index_app(of("kv_index")), name="kv_index",
                                 route_prefix=None))
        if cfg.num_ep_ranks:
            targets.append(RunTarget(app.balancer_app(of("balancer")), name="balancer",
                                     route_prefix=None))
        if cfg.planner:  # on Serve it sizes the deployments (mode scale), see planner_app
            targets.append(RunTarget(app.planner_app(of("planner", planner_mode="scale",
                                                        max_workers=cfg.max_workers or 8)),
                                     name="planner", route_prefix=None))
        targets.append(RunTarget(app.gateway_app(of("gateway")), name="gateway",
                                 route_prefix="/"))
        run_many(targets, blocking=False)
        wait_for_health(self.url, health_timeout_s)

    def _start_secure_nats(self, cfg: MeshConfig) -> MeshConfig:
        self._secrets = tempfile.mkdtemp(prefix="evenflow-secrets-")
        port = free_port()
        paths = nats_auth.write_role_secrets(Path(self._secrets), port, "127.0.0.1")
        self.credentials = {role: str(path) for role, path in paths.items()}
        self.servers.append(start_nats(port, str(Path(self._secrets) / "nats-server.conf")))
        return replace(cfg, nats_url=self.servers[-1].url)

    def supervise(self, report: object = None) -> None:
        """Ray restarts failed replicas itself: nothing for us to do."""

    def stop(self) -> int:
        """Shut Ray Serve down, then NATS and Redis; returns how many servers it stopped (Ray's
        own processes are Ray's to count)."""
        stopped = len(self.servers)
        try:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()  # (a cluster's nodes stay up: only this client leaves)
        finally:
            for server in self.servers:
                server.stop()
            self.servers.clear()
            if self._secrets:
                shutil.rmtree(self._secrets, ignore_errors=True)
        return stopped
