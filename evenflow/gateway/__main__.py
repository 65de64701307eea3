"""`python -m evenflow.gateway`: the gateway process (config from EVENFLOW_*).

With num_gateways > 1 (`evenflow up --gateways N`), N such processes share the HTTP port
(SO_REUSEPORT); each also serves its own metrics on EVENFLOW_METRICS_PORT.

SIGTERM drains: new requests get 503, running ones get EVENFLOW_DRAIN_TIMEOUT_S to finish (a
stream still running then ends with an error event and `data: [DONE]`), then the process exits.
A second SIGTERM or SIGINT exits at once."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI
from prometheus_client import start_http_server

from evenflow.gateway.app import create_app, router
from evenflow.gateway.counting import CountResponses, app_routes
from evenflow.gateway.direct import ExposeConnection
from evenflow.gateway.jobs import Gateway
from evenflow.gateway.lane import FastLane
from evenflow.services.config import MeshConfig, load_mesh_config


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.fastapi_app = app
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None

    async def serve(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        gateway: Gateway | None = self.fastapi_app.state.gateway
        if (sig != signal.SIGTERM or gateway is None or gateway.draining
                or self._loop is None):
            super().handle_exit(sig, frame)  # not serving yet, or asked twice: exit now
            return
        gateway.begin_drain()
        self._loop.call_soon_threadsafe(self._start_drain, gateway)

    def _start_drain(self, gateway: Gateway) -> None:
        self._drain = asyncio.get_running_loop().create_task(self._exit_when_drained(gateway))

    async def _exit_when_drained(self, gateway: Gateway) -> None:
        # Streams past the deadline end themselves (error event + [DONE]); a moment for that.
        while gateway.admission.running and time.monotonic() < gateway.drain_deadline + 2:
            await asyncio.sleep(0.05)
        self.should_exit = True


def shared_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port that other gateway processes bind too (SO_REUSEPORT):
    the kernel spreads new connections over them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def main(config: MeshConfig) -> None:
    config.configure_logging(f"gateway/{os.getpid()}")
    app = create_app(config)  # (its lifespan runs through ExposeConnection unchanged)
    served = ExposeConnection(CountResponses(FastLane(app, config), app_routes(router))) \
        if config.direct_stream else app
    server = DrainingServer(uvicorn.Config(
        served, host=config.host, port=config.port, loop="uvloop",
        log_level="warning" if config.log_level == "info" else config.log_level,
        timeout_graceful_shutdown=5), app)
    if config.num_gateways > 1:
        if config.metrics_port:  # /metrics on the shared port answers for one process only
            start_http_server(config.metrics_port, addr=config.metrics_host)
        server.run(sockets=[shared_socket(config.host, config.port)])
    else:
        server.run()


if __name__ == "__main__":
    main(load_mesh_config())
