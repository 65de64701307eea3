"""NATS subject names: the one place they are spelled."""

from __future__ import annotations

PREFIX = "evenflow"
HEARTBEAT = f"{PREFIX}.heartbeat"  # every worker's WorkerHeartbeat
KV_EVENTS = f"{PREFIX}.kv.events"  # KVEvents and KVSnapshot from every worker to the KV index
EXPERT_LOAD = f"{PREFIX}.eplb.load"  # ExpertLoad from every worker to the balancer
EXPERT_PLACEMENT = f"{PREFIX}.eplb.placement"  # ExpertPlacement from the balancer to workers


def kv_resync(worker_id: str) -> str:
    """KVResyncRequest for one worker."""
    return f"{PREFIX}.kv.resync.{worker_id}"


def prefill_worker(worker_id: str) -> str:
    """PrefillRequest and Cancel for one prefill worker."""
    return f"{PREFIX}.prefill.{worker_id}"


def decode_worker(worker_id: str) -> str:
    """DecodeRequest, KVBlockChunk, KVTransferComplete and Cancel for one decode worker."""
    return f"{PREFIX}.decode.{worker_id}"


def gateway_inbox(gateway_id: str) -> str:
    """TokenDeltas and ErrorMessage for one gateway."""
    return f"{PREFIX}.gateway.{gateway_id}"
