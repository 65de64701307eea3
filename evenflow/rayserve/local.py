"""`evenflow up --ray`: the mesh as Ray Serve applications on a local Ray instance, with
nats-server and redis-server started on free ports unless URLs are configured."""

from __future__ import annotations

import os
from typing import Any

from evenflow.services.config import MeshConfig
from evenflow.services.launcher import LocalServer, ensure_data_plane, wait_for_health


class LocalRayMesh:
    def __init__(self, config: MeshConfig) -> None:
        self.config = config
        self.servers: list[LocalServer] = []

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def start(self, health_timeout_s: float = 300) -> None:
        import ray
        from ray import serve

        from evenflow.rayserve import app

        cfg = self.config = ensure_data_plane(self.config, self.servers)
        args: dict[str, Any] = {k.removeprefix("EVENFLOW_").lower(): v
                                for k, v in cfg.to_env().items()}
        # Logical CPUs, not cores: the services mostly wait on the network, and each replica
        # asks for a quarter; a small machine still fits the whole mesh.
        ray.init(num_cpus=max(8, os.cpu_count() or 1), include_dashboard=False,
                 ignore_reinit_error=True)
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
        args = {**args, "num_cpus": 0.25}
        scaled = {**args, "max_replicas": 4}
        serve.run(app.decode_app({**scaled, "min_replicas": cfg.num_decode}), name="decode",
                  route_prefix=None, blocking=False)
        if cfg.num_prefill:
            serve.run(app.prefill_app({**scaled, "min_replicas": cfg.num_prefill}),
                      name="prefill", route_prefix=None, blocking=False)
        serve.run(app.kv_index_app(args), name="kv_index", route_prefix=None, blocking=False)
        if cfg.num_ep_ranks:
            serve.run(app.balancer_app(args), name="balancer", route_prefix=None,
                      blocking=False)
        serve.run(app.gateway_app(args), name="gateway", route_prefix="/", blocking=False)
        wait_for_health(self.url, health_timeout_s)

    def supervise(self, report: object = None) -> None:
        """Ray restarts failed replicas itself: nothing for us to do."""

    def stop(self) -> None:
        try:
            import ray
            from ray import serve

            serve.shutdown()
            ray.shutdown()
        finally:
            for server in self.servers:
                server.stop()
            self.servers.clear()
