"""What `evenflow doctor --url` learns from the gateway's own /metrics, scraped before and after
its workload, on a mesh started with nothing set up for it (no tracing, no bus credentials):

- the time to first token split into the gateway's phases (`evenflow_ttft_phase_seconds`,
  gateway/timings.py): a waterfall of mean milliseconds per phase, with the part the client
  saw beyond the gateway's own total (its HTTP request and the chunk's way back) as a row of
  its own, and what no phase covers as "unattributed";
- each engine worker's cost per token from its heartbeats, which the gateway re-exports
  (`evenflow_worker_*`): prefill step time per prompt token computed, decode time per output
  token as its streams saw it, against the median of its role's other workers
  (ops/stragglers.py).
"""

from __future__ import annotations

from collections import defaultdict

import httpx
from prometheus_client.parser import text_string_to_metric_families

from evenflow.ops.stragglers import against_peers

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
PHASE_METRIC = "evenflow_ttft_phase_seconds"
PHASES = ("tokenize", "admission", "route", "worker queue", "worker compute", "NATS hops",
          "first chunk")


def scrape(url: str, headers: dict[str, str] | None = None) -> Samples:
    """Every sample of the gateway's /metrics, by (name, sorted labels)."""
    text = httpx.get(url.rstrip("/") + "/metrics", headers=headers or {}, timeout=30).text
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def phase_rows(before: Samples, after: Samples, client_ttft_mean_s: float | None
               ) -> list[dict]:
    """The waterfall's rows before the first token (mean ms, share of the client's mean TTFT);
    empty when the gateway exports no phases (an older gateway) or saw no streamed request."""
    means = {}
    for phase in (*PHASES, "total"):
        count = _delta(before, after, PHASE_METRIC + "_count", phase=phase)
        if count <= 0:
            return []
        means[phase] = _delta(before, after, PHASE_METRIC + "_sum", phase=phase) / count
    base = client_ttft_mean_s or means["total"]
    rows = [{"phase": f"gateway: {phase}", "p50": None, "mean": means[phase] * 1e3,
             "p99": None, "share": means[phase] / base, "of": "TTFT", "spans": 0}
            for phase in PHASES]
    covered = sum(means[p] for p in PHASES)
    if client_ttft_mean_s is not None:
        outside = client_ttft_mean_s - means["total"]
        rows.append({"phase": "HTTP and client (client TTFT - gateway TTFT)", "p50": None,
                     "mean": outside * 1e3, "p99": None, "share": outside / base, "of": "TTFT",
                     "spans": 0})
        covered += outside
    rest = base - covered
    rows.append({"phase": "unattributed", "p50": None, "mean": rest * 1e3, "p99": None,
                 "share": rest / base, "of": "TTFT", "spans": 0})
    return rows


def worker_instances(before: Samples, after: Samples) -> list[dict]:
    """Per engine worker over the window, from its heartbeats as the gateway re-exports them."""
    workers: dict[str, str] = {}
    for name, pairs in after:
        if name == "evenflow_worker_step_seconds":
            found = dict(pairs)
            workers[found["worker"]] = found["role"]
    cost: dict[str, dict[str, float]] = defaultdict(dict)
    for worker, role in workers.items():
        labels = {"role": role, "worker": worker}
        if role == "prefill":
            seconds = _delta(before, after, "evenflow_worker_step_seconds", **labels)
            tokens = _delta(before, after, "evenflow_worker_prompt_tokens_computed", **labels)
        else:
            seconds = _delta(before, after, "evenflow_worker_stream_seconds", **labels)
            tokens = _delta(before, after, "evenflow_worker_stream_tokens", **labels)
        if tokens > 0 and seconds > 0:  # (a restarted worker's counters went down: skipped)
            cost[role][worker] = seconds / tokens
    out = []
    for role in ("prefill", "decode"):
        if not cost[role]:
            continue
        peers = against_peers(cost[role])
        for worker, value in sorted(cost[role].items()):
            out.append({"role": role, "worker": worker, "ms_per_token": value * 1e3,
                        "vs_peers": peers[worker].vs_peers,
                        "straggler": peers[worker].straggler, "samples": 0,
                        "source": "heartbeats"})
    return out
