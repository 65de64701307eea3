"""Prometheus metrics shared by the services (one registry per process)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

MESSAGES_DROPPED = Counter("evenflow_messages_dropped_total",
                           "Wire messages dropped as malformed or unknown", ["service"])
REQUESTS = Counter("evenflow_requests_total", "Requests finished at the gateway",
                   ["endpoint", "outcome"])
TTFT = Histogram("evenflow_ttft_seconds", "Time to first token at the gateway",
                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
INFLIGHT = Gauge("evenflow_inflight_requests", "Requests in flight at the gateway")
LIVE_WORKERS = Gauge("evenflow_live_workers", "Workers with a fresh heartbeat", ["role"])
ROUTING_DECISIONS = Counter("evenflow_routing_decisions_total", "Requests routed, by reason",
                            ["reason"])
KV_LOOKUP_SECONDS = Histogram("evenflow_kv_lookup_seconds", "KV index match latency at the gateway",
                              buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05))
PROMPT_TOKENS = Counter("evenflow_prompt_tokens_total", "Prompt tokens served", ["worker"])
CACHED_TOKENS = Counter("evenflow_cached_prompt_tokens_total",
                        "Prompt tokens served from a prefix cache (actual)", ["worker"])
PREDICTED_CACHED_TOKENS = Counter("evenflow_predicted_cached_prompt_tokens_total",
                                  "Prompt tokens the router expected to be cached")
RETRIES = Counter("evenflow_request_retries_total",
                  "Requests re-sent elsewhere by the gateway, by the error that caused it",
                  ["code"])
KV_TRANSFER_BYTES = Counter("evenflow_kv_transfer_bytes_total", "KV bytes shipped", ["service"])


def render() -> tuple[bytes, str]:
    return generate_latest(), CONTENT_TYPE_LATEST
