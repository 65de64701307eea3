"""Error codes that cross the wire in ErrorMessage.code."""

from __future__ import annotations

NO_CAPACITY = "no_capacity"  # the decode worker has no KV room: retry elsewhere
BAD_REQUEST = "bad_request"  # the engine rejected the request (length, vocabulary, params)
KV_TRANSFER_FAILED = "kv_transfer_failed"  # a chunk went missing, arrived twice, or timed out
WORKER_ERROR = "worker_error"  # an unexpected failure inside a worker
DRAINING = "draining"  # the worker is shutting down: retry elsewhere
# the worker switched role (or is switching): retry elsewhere; the worker itself lives on
ROLE_SWITCHED = "role_switched"
ENGINE_FAILED = "engine_failed"  # an engine step raised; its requests were dropped
TIMEOUT = "timeout"  # the request's deadline passed, or it stalled (gateway only)
LOST_IN_OUTAGE = "lost_in_outage"  # nothing came back after a NATS outage (gateway only)

# Retried by the gateway elsewhere, within its retry budget (a chunk lost or sent twice is a
# transient transfer fault: a fresh prefill succeeds).
RETRYABLE = frozenset({NO_CAPACITY, DRAINING, KV_TRANSFER_FAILED, ENGINE_FAILED,
                       LOST_IN_OUTAGE, ROLE_SWITCHED})
