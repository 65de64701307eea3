"""NATS subject names: the one place they are spelled. Each kind of message has subjects of its
own, so the server's per-service permissions (services/nats_auth.py) can say who may send what:
only the gateway sends requests to workers, only prefill workers send KV transfers, only workers
answer a gateway, only the balancer sends placements, and everyone heartbeats on a subject of
its own (a heartbeat on any other subject is dropped: services/bus.py)."""

from __future__ import annotations

PREFIX = "evenflow"
HEARTBEATS = f"{PREFIX}.heartbeat.>"  # every service's heartbeat (subscribe here)
KV_EVENTS = f"{PREFIX}.kv.events"  # KVEvents and KVSnapshot from every worker to the KV index
EXPERT_LOAD = f"{PREFIX}.eplb.load"  # ExpertLoad from every worker to the balancer
EXPERT_PLACEMENT = f"{PREFIX}.eplb.placement"  # ExpertPlacement from the balancer to workers
# FleetTarget from the planner (mode `scale`) to whoever sizes the fleet: `evenflow up`'s
# launcher, and the engine workers (who report it to Ray Serve's autoscaling policies)
FLEET_TARGET = f"{PREFIX}.fleet.target"


def heartbeat(role: str, worker_id: str) -> str:
    """One service's WorkerHeartbeat (role: prefill, decode, kv_index, balancer, gateway)."""
    return f"{PREFIX}.heartbeat.{role}.{worker_id}"


def kv_resync(worker_id: str) -> str:
    """KVResyncRequest for one worker."""
    return f"{PREFIX}.kv.resync.{worker_id}"


def prefill_worker(worker_id: str) -> str:
    """PrefillRequest and Cancel for one prefill worker (from gateways)."""
    return f"{PREFIX}.prefill.{worker_id}"


def decode_worker(worker_id: str) -> str:
    """DecodeRequest and Cancel for one decode worker (from gateways)."""
    return f"{PREFIX}.decode.{worker_id}"


def kv_transfer(worker_id: str) -> str:
    """KVBlockChunk and KVTransferComplete for one decode worker (from prefill workers)."""
    return f"{PREFIX}.kvx.{worker_id}"


def kv_pull(worker_id: str) -> str:
    """KVPullRequest for one worker holding KV (from prefill workers)."""
    return f"{PREFIX}.kvpull.{worker_id}"


def kv_pulled(worker_id: str) -> str:
    """KVBlockChunk and KVPullDone answering one prefill worker's pulls (from holders)."""
    return f"{PREFIX}.kvpulled.{worker_id}"


def gateway_inbox(gateway_id: str) -> str:
    """TokenDeltas and ErrorMessage for one gateway."""
    return f"{PREFIX}.gateway.{gateway_id}"


def router_sync(gateway_id: str) -> str:
    """RouterSync from one gateway to the others."""
    return f"{PREFIX}.router.{gateway_id}"


def control(worker_id: str) -> str:
    """RoleSwitch for one engine worker (from the planner)."""
    return f"{PREFIX}.control.{worker_id}"


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, a final `>` one or more."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)
