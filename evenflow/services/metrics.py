"""Prometheus metrics shared by the services (one registry per process).

Two families. vLLM-compatible series (`vllm:*`, labelled `model_name`) so vLLM's and Dynamo's
dashboards work unchanged; each is exported by exactly one kind of process, so a `sum()` over
every scrape target counts each thing once: request-level ones (TTFT, inter-token latency,
end-to-end latency, outcomes, prompt / generation tokens, prefix-cache queries and hits, in
tokens) by the gateway, which sees every request once; engine-level ones (running, waiting, KV
cache use) by each engine worker on its own `/metrics` port. And evenflow's own series for
routing, KV transfer, the index, the balancer and dropped messages.

Several gateway processes on one port share a Prometheus multiprocess directory: /metrics on
the port sums them all (`render`), and each one's own metrics port answers for it alone; so
scrape one or the other. Gauges therefore say how to combine (multiprocess_mode).
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from evenflow.services.engine_api import KVDiskCounts, SpecCounts

log = logging.getLogger(__name__)

MESSAGES_DROPPED = Counter("evenflow_messages_dropped_total",
                           "Wire messages dropped, by why (services/bus.py drop_kind)",
                           ["service", "reason"])
REQUESTS = Counter("evenflow_requests_total", "Requests finished at the gateway",
                   ["endpoint", "outcome"])
TTFT = Histogram("evenflow_ttft_seconds", "Time to first token at the gateway",
                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
# The gateway's time to first token of a streamed request, split (gateway/timings.py): the
# phases, and "total" (from the request's handler to its first chunk handed to the server)
TTFT_PHASE_SECONDS = Histogram(
    "evenflow_ttft_phase_seconds", "A streamed request's time to first token at the gateway, "
    "by phase", ["phase"], buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                    0.5, 1, 2.5, 5, 10))
# Each engine worker's cumulative figures as its heartbeats carry them (WorkerHeartbeat v4),
# re-exported by the gateway, which hears every worker: per-instance evidence on the gateway's
# own /metrics (`evenflow doctor --url`), whatever the mesh was started with
WORKER_STEP_SECONDS = Gauge("evenflow_worker_step_seconds",
                            "A worker's engine step time so far (its heartbeat)",
                            ["role", "worker"], multiprocess_mode="livemostrecent")
WORKER_PROMPT_TOKENS = Gauge("evenflow_worker_prompt_tokens_computed",
                             "Prompt tokens a worker computed so far (its heartbeat)",
                             ["role", "worker"], multiprocess_mode="livemostrecent")
WORKER_STREAM_SECONDS = Gauge("evenflow_worker_stream_seconds",
                              "Seconds a decode worker's streams ran, first token to last, so "
                              "far (its heartbeat)", ["role", "worker"],
                              multiprocess_mode="livemostrecent")
WORKER_STREAM_TOKENS = Gauge("evenflow_worker_stream_tokens",
                             "Tokens over those seconds (its heartbeat)", ["role", "worker"],
                             multiprocess_mode="livemostrecent")


def export_worker_figures(beat: Any) -> None:
    """An engine worker's heartbeat (WorkerHeartbeat v4) into the WORKER_* gauges."""
    labels = (str(beat.role), beat.worker_id)
    WORKER_STEP_SECONDS.labels(*labels).set(beat.step_seconds)
    WORKER_PROMPT_TOKENS.labels(*labels).set(beat.prompt_tokens_computed)
    WORKER_STREAM_SECONDS.labels(*labels).set(beat.stream_seconds)
    WORKER_STREAM_TOKENS.labels(*labels).set(beat.stream_tokens)
    for role in ("prefill", "decode"):  # (a worker that switched role: the old one goes to 0)
        WORKER_ROLE.labels(beat.worker_id, role).set(1 if role == str(beat.role) else 0)


# role switching (services/engine_worker.py) and the planner (evenflow/planner/)
WORKER_ROLE = Gauge("evenflow_worker_role", "1 for the role a worker serves now, 0 for the one "
                    "it left (its heartbeat)", ["worker", "role"],
                    multiprocess_mode="livemostrecent")
ROLE_SWITCHES = Counter("evenflow_role_switches_total", "Role switches an engine worker made",
                        ["from_role", "to_role"])
ROLE_SWITCH_SECONDS = Histogram("evenflow_role_switch_seconds", "A role switch, from the order "
                                "to serving the new role (its drain included)",
                                buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
ROLE_SWITCH_MIGRATED = Counter("evenflow_role_switch_migrated_total", "Requests a switching "
                               "worker handed back to the gateways (retried elsewhere, what was "
                               "streamed kept) when its drain bound passed")
PLANNER_TARGET_WORKERS = Gauge("evenflow_planner_target_workers", "The planner's target worker "
                               "count per role", ["role"])
PLANNER_LIVE_WORKERS = Gauge("evenflow_planner_live_workers", "Workers per role as the planner "
                             "saw them at its last decision", ["role"])
PLANNER_DECISIONS = Counter("evenflow_planner_decisions_total", "The planner's decisions, by "
                            "action (hold, switch, start, stop, advise)", ["action"])
PLANNER_ESTIMATE = Gauge("evenflow_planner_estimate", "What the planner estimated at its last "
                         "decision (ttft_s, itl_s at the current split; prompt_tps, "
                         "decode_streams demanded)", ["quantity"])


HTTP_REQUESTS = Counter("evenflow_http_requests_total",
                        "HTTP responses of the gateway, by status code and route (other: a path "
                        "that is not the gateway's)", ["code", "route"])
REFUSALS = Counter("evenflow_refusals_total", "Requests the gateway refused (status 400 and "
                   "up), by the error's code", ["reason"])
INFLIGHT = Gauge("evenflow_inflight_requests", "Requests in flight at the gateway",
                 multiprocess_mode="livesum")
QUEUED_REQUESTS = Gauge("evenflow_queued_requests", "Requests waiting for an admission slot at "
                        "the gateway, by tenant", ["tenant"], multiprocess_mode="livesum")
ADMISSION_REFUSALS = Counter("evenflow_admission_refusals_total", "Requests refused with 429 "
                             "at admission, by the limit hit", ["reason"])
ADMISSION_WAIT_SECONDS = Histogram("evenflow_admission_wait_seconds", "Time queued for an "
                                   "admission slot, by priority class", ["priority"],
                                   buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
LIVE_WORKERS = Gauge("evenflow_live_workers", "Workers with a fresh heartbeat", ["role"],
                     multiprocess_mode="livemostrecent")
ROUTING_DECISIONS = Counter("evenflow_routing_decisions_total", "Requests routed, by reason",
                            ["reason"])
KV_LOOKUP_SECONDS = Histogram("evenflow_kv_lookup_seconds", "KV index match latency at the gateway",
                              buckets=(0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.001, 0.002,
                                       0.005, 0.01, 0.05))
# A routing decision: hashing the prompt, the index match, picking the workers (not the wait for
# a worker with room, nor the publish)
# (`index`: where its KV match was answered: local — the gateway's copy —, redis, or none)
ROUTE_DECISION_SECONDS = Histogram(
    "evenflow_route_decision_seconds", "A routing decision at the gateway", ["index"],
    buckets=(0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.002, 0.005, 0.01,
             0.05))
# the same decisions' own CPU time (the gateway thread's): on a loaded host the wall time above
# also holds the time the gateway waited for a core
ROUTE_DECISION_CPU_SECONDS = Histogram(
    "evenflow_route_decision_cpu_seconds", "A routing decision's CPU time at the gateway",
    ["index"], buckets=(0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.002, 0.005,
                        0.01, 0.05))
KV_LOOKUPS = Counter("evenflow_kv_lookups_total",
                     "KV index matches at the gateway, by where they were answered", ["source"])
KV_INDEX_FALLBACKS = Counter(
    "evenflow_kv_index_fallbacks_total",
    "Matches the gateway's local copy of the index could not answer (sent to Redis)", ["reason"])
PROMPT_TOKENS = Counter("evenflow_prompt_tokens_total", "Prompt tokens served", ["worker"])
CACHED_TOKENS = Counter("evenflow_cached_prompt_tokens_total",
                        "Prompt tokens served from a prefix cache (actual)", ["worker"])
PREDICTED_CACHED_TOKENS = Counter("evenflow_predicted_cached_prompt_tokens_total",
                                  "Prompt tokens the router expected to be cached")
RETRIES = Counter("evenflow_request_retries_total",
                  "Requests re-sent elsewhere by the gateway, by the error that caused it",
                  ["code"])
KV_TRANSFER_BYTES = Counter("evenflow_kv_transfer_bytes_total", "KV bytes shipped", ["service"])
# KV pulls (services/kv_pull.py): a prefill worker fetching a prefix another worker holds
KV_PULLS = Counter("evenflow_kv_pulls_total", "KV pulls a prefill worker made, by outcome "
                   "(pulled, empty: the holder had none of them, timeout, refused, broken)",
                   ["outcome"])
KV_PULLED_BLOCKS = Counter("evenflow_kv_pulled_blocks_total",
                           "KV blocks pulled from other workers into this prefix cache")
KV_PULLS_SERVED = Counter("evenflow_kv_pulls_served_total",
                          "KV pulls this worker answered, and the blocks it sent", ["what"])
KV_PULL_REPLIES_DROPPED = Counter(
    "evenflow_kv_pull_replies_dropped_total",
    "KV pull answers dropped: for no pull under way, or without the pull's nonce (forged)",
    ["reason"])
KV_PULL_SECONDS = Histogram("evenflow_kv_pull_seconds",
                            "A successful KV pull, request to the last byte",
                            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                     2.5))
# An engine worker's KV disk tier (engine/runners/kv_tiers.py), in blocks; each worker on its own
# /metrics port. A miss is a prefix lookup that stopped at a block the tier held or had held:
# reason "evicted" (the tier dropped it to make room, while the KV index could still name it),
# "no_room" (held, but no free RAM block to promote it into: the request waits for room).
KV_DISK_HITS = Counter("evenflow_kv_disk_hits_total",
                       "KV blocks a prefix lookup or a KV pull found on the disk tier")
KV_DISK_PROMOTIONS = Counter("evenflow_kv_disk_promotions_total",
                             "KV blocks read back from the disk tier into RAM")
KV_DISK_WRITES = Counter("evenflow_kv_disk_writes_total",
                         "KV blocks evicted from RAM and written to the disk tier")
KV_DISK_EVICTIONS = Counter("evenflow_kv_disk_evictions_total",
                            "KV blocks the disk tier dropped to make room")
KV_DISK_MISSES = Counter("evenflow_kv_disk_misses_total",
                         "Prefix lookups (once per request) stopped at a block the disk tier "
                         "held or had just dropped, by reason", ["reason"])


def export_kv_disk_counts(counts: KVDiskCounts, seen: dict[str, int]) -> None:
    """Add an engine's cumulative disk-tier counts to the KV_DISK_* counters: their increase
    since `seen` (the values at the last call, updated here)."""
    values = {"hits": counts.hits, "promotions": counts.promotions, "writes": counts.writes,
              "evictions": counts.evictions}
    values.update({f"miss:{reason}": n for reason, n in counts.misses.items()})
    totals = {"hits": KV_DISK_HITS, "promotions": KV_DISK_PROMOTIONS, "writes": KV_DISK_WRITES,
              "evictions": KV_DISK_EVICTIONS}
    for key, value in values.items():
        # (every reason's series exists from the first export on, at 0 until a miss)
        counter = totals.get(key) or KV_DISK_MISSES.labels(reason=key.removeprefix("miss:"))
        increase = value - seen.get(key, 0)
        if increase > 0:
            counter.inc(increase)
        seen[key] = value


LOOP_LAG = Histogram("evenflow_event_loop_lag_seconds",
                     "How late a 50 ms timer fires on this process's event loop",
                     buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0,
                              2.5))
LOOP_LAG_INTERVAL_S = 0.05
LOOP_LAG_WARN_S = 0.05  # a lag above this is logged (rate-limited)
LOOP_LAG_WARN_EVERY_S = 10.0


async def watch_loop_lag(warn_s: float = LOOP_LAG_WARN_S,
                         warn_every_s: float = LOOP_LAG_WARN_EVERY_S) -> None:
    """Run on a service's loop: every 50 ms, how late the timer fired (a busy loop: late).
    A lag over warn_s is logged as a warning, at most once per warn_every_s (with the worst
    lag and how many times since the last warning)."""
    loop = asyncio.get_running_loop()
    last_warned, worst, times = float("-inf"), 0.0, 0
    while True:
        before = loop.time()
        await asyncio.sleep(LOOP_LAG_INTERVAL_S)
        lag = max(0.0, loop.time() - before - LOOP_LAG_INTERVAL_S)
        LOOP_LAG.observe(lag)
        if lag > warn_s:
            worst, times = max(worst, lag), times + 1
            if loop.time() - last_warned >= warn_every_s:
                log.warning("event loop lagged %.0f ms (%d time(s) over %.0f ms since the last "
                            "warning): something blocks this process's loop", worst * 1e3,
                            times, warn_s * 1e3)
                last_warned, worst, times = loop.time(), 0.0, 0

# -- vLLM-compatible names -------------------------------------------------------------------
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_TTFT = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                      ["model_name"], buckets=_LATENCY)
VLLM_ITL = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens",
                     ["model_name"], buckets=_LATENCY)
VLLM_E2E = Histogram("vllm:e2e_request_latency_seconds", "Request latency, end to end",
                     ["model_name"], buckets=_LATENCY + (160.0, 320.0))
VLLM_SUCCESS = Counter("vllm:request_success", "Requests finished, by finish reason",
                       ["model_name", "finished_reason"])
VLLM_PROMPT_TOKENS = Counter("vllm:prompt_tokens", "Prompt tokens", ["model_name"])
VLLM_GENERATION_TOKENS = Counter("vllm:generation_tokens", "Generated tokens", ["model_name"])
VLLM_PREFIX_QUERIES = Counter("vllm:prefix_cache_queries",
                              "Prompt tokens looked up in a prefix cache", ["model_name"])
VLLM_PREFIX_HITS = Counter("vllm:prefix_cache_hits", "Prompt tokens found in a prefix cache",
                           ["model_name"])
VLLM_RUNNING = Gauge("vllm:num_requests_running", "Requests running in the engine",
                     ["model_name"], multiprocess_mode="livemostrecent")
VLLM_WAITING = Gauge("vllm:num_requests_waiting", "Requests waiting in the engine",
                     ["model_name"], multiprocess_mode="livemostrecent")
VLLM_KV_USAGE = Gauge("vllm:kv_cache_usage_perc", "KV cache in use (0-1)", ["model_name"],
                      multiprocess_mode="livemostrecent")
# speculative decoding (engine/serving/speculation.py), vLLM's names
VLLM_SPEC_DRAFTS = Counter("vllm:spec_decode_num_drafts", "Drafts verified", ["model_name"])
VLLM_SPEC_DRAFT_TOKENS = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified",
                                 ["model_name"])
VLLM_SPEC_ACCEPTED = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                             ["model_name"])
VLLM_SPEC_ACCEPTED_AT = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                "Draft tokens accepted, by their place in the draft",
                                ["model_name", "position"])


def export_spec_counts(counts: SpecCounts, model: str, seen: dict[str, int]) -> None:
    """Add an engine's cumulative speculative-decoding counts to the VLLM_SPEC_* counters:
    their increase since `seen` (updated here)."""
    values = {"drafts": (VLLM_SPEC_DRAFTS.labels(model), counts.drafts),
              "tokens": (VLLM_SPEC_DRAFT_TOKENS.labels(model), counts.draft_tokens),
              "accepted": (VLLM_SPEC_ACCEPTED.labels(model), counts.accepted_tokens)}
    for position, n in enumerate(counts.accepted_per_position):
        values[f"at{position}"] = (VLLM_SPEC_ACCEPTED_AT.labels(model, str(position)), n)
    for key, (counter, value) in values.items():
        if value > seen.get(key, 0):
            counter.inc(value - seen.get(key, 0))
        seen[key] = value


_CHILDREN: dict[tuple[int, tuple[str, ...]], Any] = {}


def labelled(metric: Any, *values: str) -> Any:
    """metric.labels(*values), remembered: labels() costs ~0.7 µs (a lock and a dict), and a
    request makes ~15 of them. For metrics whose children are never removed."""
    key = (id(metric), values)
    child = _CHILDREN.get(key)
    if child is None:
        child = _CHILDREN[key] = metric.labels(*values)
    return child


def render() -> tuple[bytes, str]:
    """This process's metrics; where several gateway processes share a port (the launcher sets
    PROMETHEUS_MULTIPROC_DIR for them, as vLLM does for its API servers), all of theirs summed:
    counters and histograms added up, in-flight requests summed over the live ones, and the
    worker figures each one re-exports from the same heartbeats taken once (the latest)."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory:
        return generate_latest(), CONTENT_TYPE_LATEST
    from prometheus_client import CollectorRegistry, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, directory)
    return generate_latest(registry), CONTENT_TYPE_LATEST
