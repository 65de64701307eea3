"""Who may say what on the bus: per-service NATS users with subject permissions, the
nats-server configuration `evenflow up` writes for them, and the credential files the services
read (mode 0600; never argv, never the environment: a service gets only the path).

Permissions (`{id}` is the service's own id; P = "evenflow"):

  gateway        pub P.prefill.*, P.decode.*, P.kv.resync.*, P.heartbeat.gateway.*
                 sub P.gateway.*, P.heartbeat.>, P.kv.events (its copy of the KV index)
  prefill-{id}   pub P.gateway.*, P.kvx.*, P.kv.events, P.eplb.load, P.heartbeat.prefill.{id}
                 sub P.prefill.{id}, P.kv.resync.{id}, P.eplb.placement, P.heartbeat.gateway.*,
                     P.heartbeat.decode.* (a request's decode worker must be alive)
  decode-{id}    pub P.gateway.*, P.kv.events, P.eplb.load, P.heartbeat.decode.{id}
                 sub P.decode.{id}, P.kvx.{id}, P.kv.resync.{id}, P.eplb.placement,
                     P.heartbeat.gateway.*, P.heartbeat.decode.*
  kv_index-{id}  pub P.kv.resync.*, P.heartbeat.kv_index.{id}
                 sub P.kv.events, P.heartbeat.>
  balancer-{id}  pub P.eplb.placement, P.heartbeat.balancer.{id}
                 sub P.eplb.load, P.heartbeat.>
  planner-{id}   pub P.control.*, P.fleet.target, P.heartbeat.planner.{id}
                 sub P.heartbeat.>
  engine-{id}    a worker that may switch role (`--planner` with switching): the prefill and
                 decode permissions of {id} together
(every prefill and decode worker also subscribes to P.control.{id}, the planner's RoleSwitch,
and to P.fleet.target, its FleetTarget, which a Ray Serve replica reports to the autoscaler.)
  admin          pub >  sub >  (operators, benchmarks, tests)

Deployments whose worker ids are not known in advance (Ray Serve replicas, compose, KubeRay)
use one user per role instead (`role_users`: `{id}` becomes `*`, the user is named after the
role): roles stay apart, though a worker could then heartbeat as another worker of its role.
`evenflow bus-secrets DIR` writes that server configuration and the role credential files.

So: only the gateway sends requests to workers; only prefill workers send KV transfers; only
workers answer a gateway; only the balancer sends placements; a worker heartbeats on its own
subject only (and the bus drops a heartbeat on any subject but its sender's). A user without a
password is refused by the server: there is no anonymous access.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from evenflow.proto import subjects

P = subjects.PREFIX
K = TypeVar("K")


@dataclass(frozen=True)
class NatsUser:
    name: str
    password: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def permissions(role: str, worker_id: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(publish, subscribe) subject patterns for one service."""
    own_heartbeat = subjects.heartbeat(role, worker_id)
    # every worker answers KV pulls from the blocks it holds (prefill workers ask)
    worker_in = (subjects.kv_resync(worker_id), subjects.EXPERT_PLACEMENT,
                 subjects.heartbeat("gateway", "*"), subjects.heartbeat("decode", "*"),
                 subjects.kv_pull(worker_id),
                 subjects.control(worker_id), subjects.FLEET_TARGET)
    worker_out = (f"{P}.gateway.*", subjects.KV_EVENTS, subjects.EXPERT_LOAD, own_heartbeat,
                  subjects.kv_pulled("*"))
    table: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
        "gateway": ((f"{P}.prefill.*", f"{P}.decode.*", subjects.kv_resync("*"),
                     subjects.heartbeat("gateway", "*"), subjects.router_sync("*")),
                    (f"{P}.gateway.*", subjects.HEARTBEATS, subjects.KV_EVENTS,
                     subjects.router_sync("*"))),
        "prefill": ((*worker_out, subjects.kv_transfer("*"), subjects.kv_pull("*")),
                    (subjects.prefill_worker(worker_id), subjects.kv_pulled(worker_id),
                     *worker_in)),
        "decode": (worker_out,
                   (subjects.decode_worker(worker_id), subjects.kv_transfer(worker_id),
                    *worker_in)),
        "kv_index": ((subjects.kv_resync("*"), own_heartbeat),
                     (subjects.KV_EVENTS, subjects.HEARTBEATS)),
        "balancer": ((subjects.EXPERT_PLACEMENT, own_heartbeat),
                     (subjects.EXPERT_LOAD, subjects.HEARTBEATS)),
        "planner": ((subjects.control("*"), subjects.FLEET_TARGET, own_heartbeat),
                    (subjects.HEARTBEATS,)),
        "admin": ((">",), (">",)),
    }
    if role == "engine":  # both engine roles' permissions: it switches between them
        (p_pub, p_sub), (d_pub, d_sub) = (permissions(r, worker_id) for r in ("prefill",
                                                                              "decode"))
        return tuple(dict.fromkeys(p_pub + d_pub)), tuple(dict.fromkeys(p_sub + d_sub))
    return table[role]


ROLES = ("gateway", "prefill", "decode", "kv_index", "balancer", "planner", "engine", "admin")


def make_user(role: str, worker_id: str) -> NatsUser:
    name = role if role in ("gateway", "admin") or worker_id == "*" else f"{role}-{worker_id}"
    publish, subscribe = permissions(role, worker_id)
    return NatsUser(name, secrets.token_urlsafe(24), publish, subscribe)


def role_users() -> dict[str, NatsUser]:
    """One user per role, for any worker id of that role."""
    return {role: make_user(role, "*") for role in ROLES}


def server_config(port: int, users: list[NatsUser], host: str = "127.0.0.1") -> str:
    """nats-server configuration: listen on `host`, these users and nobody else."""
    def entry(u: NatsUser) -> str:
        allow = {"publish": {"allow": list(u.publish)}, "subscribe": {"allow": list(u.subscribe)}}
        return json.dumps({"user": u.name, "password": u.password, "permissions": allow})

    entries = ",\n    ".join(entry(u) for u in users)
    return f'listen: "{host}:{port}"\nauthorization {{\n  users = [\n    {entries}\n  ]\n}}\n'


def write_private(path: Path, text: str) -> Path:
    """A file only this user can read (0600), created fresh."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def write_credentials(directory: Path, user: NatsUser) -> Path:
    return write_private(directory / f"nats-{user.name}.creds", f"{user.name}\n{user.password}\n")


def read_credentials(path: str) -> tuple[str, str]:
    """(user, password) from a credentials file: two lines."""
    lines = Path(path).read_text().split()
    if len(lines) != 2:
        raise ValueError(f"{path}: expected two lines, user and password")
    return lines[0], lines[1]


def write_secrets(directory: Path, users: dict[K, NatsUser], port: int,
                  host: str = "127.0.0.1") -> dict[K, Path]:
    """nats-server.conf for these users and a credentials file per user in `directory`
    (created 0700, files 0600); the credentials paths by the users' keys."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_private(directory / "nats-server.conf", server_config(port, list(users.values()), host))
    return {key: write_credentials(directory, user) for key, user in users.items()}


def write_role_secrets(directory: Path, port: int = 4222,
                       host: str = "0.0.0.0") -> dict[str, Path]:
    """The deployment's secrets: one user per role."""
    return write_secrets(directory, role_users(), port, host)
