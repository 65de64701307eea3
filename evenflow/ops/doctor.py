"""`evenflow doctor`: name the straggler.

Starts a local mesh whose every service exports its spans to an OTLP receiver in this process,
runs a workload through it (`chat`: many streams of short prompts, which a gateway's default
settings prefill on the decode worker, and every fourth one of 384 tokens, which goes to a
prefill worker; `long-prompt`: 1,500-token prompts; `burst`: everything at once), and then,
from the traces, the services' metrics and the client's own timings, prints:
- a waterfall per request phase (route, prefill queue, prefill compute, KV transfer, decode
  queue, time to first token, decode per output token, end to end) as p50 / p99 and its share
  of TTFT (the phases before the first token) or of the end-to-end time;
- the slowest instance: each worker's prefill ms per prompt token or decode ms per output token
  against the median of its role's other workers; more than 1.5x that, and it is named
  (ops/stragglers.py);
- the gateway's event-loop lag p99;
- with expert-parallel (DEP) workers (`--expert-parallel N` here, or `--nats URL` with `--url`):
  each EP rank's MoE compute, collective wait and rows per step from the reports it sends the
  balancer, against the median of its group's other ranks;
- a verdict naming the slowest layer and instance, with the evidence.
`--json FILE` writes the same as JSON, `--png FILE` the waterfall as a chart.

`--url URL` points it at a running mesh instead (its gateway): the workload goes there. With
`--nats URL` (the mesh's NATS, with rights to read every subject: the admin user's) it compares
the workers from their heartbeats (prefill: engine step time per prompt token; decode: time per
output token as each stream saw it), however the mesh was started. The phases come from
traces, if the services export to the doctor's receiver — start the mesh
with OTEL_EXPORTER_OTLP_ENDPOINT=http://HOST:PORT and give the doctor `--otlp-port PORT`
(default 4318, OTLP/HTTP's port); `--otlp-host 0.0.0.0` when the services run elsewhere. An API
key, if the gateway needs one, comes from OPENAI_API_KEY. Without traces it still reports the
client's TTFT and end-to-end times and the gateway's loop lag, and says the traces are missing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from collections import defaultdict
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from evenflow.bench.loadgen import LoadResult, make_prompts, percentile, run_client, run_load
from evenflow.bench.machine import scratch_dir
from evenflow.ops.doctor_metrics import Samples, phase_rows, scrape, worker_instances
from evenflow.ops.otlp_receiver import OTLPReceiver, ReceivedSpan
from evenflow.ops.stragglers import STANDS_OUT, against_peers

# A gateway prefills a prompt shorter than its local-prefill threshold (MeshConfig's
# local_prefill_threshold, 128 tokens by default) on the decode worker itself: a workload of
# short prompts only never reaches the prefill workers, and the doctor could not compare them.
LONG_CHAT_PROMPT = 384
WORKLOADS = {  # prompt tokens (cycled over the requests), output tokens, requests, concurrency
    "chat": ((96, 96, 96, LONG_CHAT_PROMPT), 32, 48, 8),
    "long-prompt": ((1500,), 16, 16, 4),
    "burst": ((256,), 32, 64, 64),
}


def prompt_lengths(lengths: tuple[int, ...], requests: int) -> list[int]:
    """Each request's prompt length: the workload's lengths, cycled."""
    return [lengths[i % len(lengths)] for i in range(requests)]


# span -> phase of the waterfall; before the first token unless marked
PHASES = [("route", "route", True), ("prefill.queue", "prefill queue", True),
          ("prefill.compute", "prefill compute", True), ("kv_transfer", "KV transfer", False),
          ("decode.queue", "decode queue", False)]


def _ms(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None}
    return {"p50": percentile(values, 50) * 1e3, "p99": percentile(values, 99) * 1e3}


def analyse(spans: list[ReceivedSpan], ttfts: list[float], e2es: list[float],
            loop_lag_p99_s: float | None, ep_ranks: list[dict] | None = None,
            from_heartbeats: list[dict] | None = None,
            gateway_metrics: tuple[Samples, Samples] | None = None) -> dict:
    """from_heartbeats: per-worker costs from the workers' heartbeats (WorkerStepWatch), used
    for the workers no trace covers (a mesh started without tracing); gateway_metrics: the
    gateway's /metrics before and after the workload (ops/doctor_metrics.py): the phases
    before the first token and the workers, where no trace says."""
    by_name: dict[str, list[ReceivedSpan]] = defaultdict(list)
    for span in spans:
        by_name[span.name].append(span)
    ttft_p50 = percentile(ttfts, 50) if ttfts else float("nan")
    e2e_p50 = percentile(e2es, 50) if e2es else float("nan")
    rows = []
    for span_name, label, before_first in PHASES:
        durations = [s.duration_s for s in by_name.get(span_name, [])]
        stats = _ms(durations)
        base = ttft_p50 if before_first else e2e_p50
        share = (percentile(durations, 50) / base) if durations and base else None
        rows.append({"phase": label, **stats, "share": share,
                     "of": "TTFT" if before_first else "end to end", "spans": len(durations)})
    per_token = []
    for s in by_name.get("decode.generate", []):
        tokens = int(s.attributes.get("gen_ai.usage.output_tokens", 0) or 0)
        if tokens > 1:
            per_token.append(s.duration_s / tokens)
    rows.append({"phase": "decode, per output token", **_ms(per_token), "share": None,
                 "of": "", "spans": len(per_token)})
    rows.append({"phase": "time to first token (client)", **_ms(ttfts), "share": 1.0,
                 "of": "TTFT", "spans": len(ttfts)})
    rows.append({"phase": "end to end (client)", **_ms(e2es), "share": 1.0, "of": "end to end",
                 "spans": len(e2es)})
    accounted = sum(r["share"] or 0 for r in rows[:3])
    rows.insert(3, {"phase": "gateway, NATS hops, tokenize, detokenize (rest of TTFT)",
                    "p50": (1 - accounted) * ttft_p50 * 1e3 if ttfts else None, "p99": None,
                    "share": 1 - accounted if ttfts else None, "of": "TTFT", "spans": 0})
    instances = _instances(by_name)
    if gateway_metrics is not None and not by_name.get("route"):  # no traces: the gateway's
        metric_rows = phase_rows(*gateway_metrics, statistics.mean(ttfts) if ttfts else None)
        if metric_rows:
            rows = metric_rows + rows[4:]  # (KV transfer, decode and the client's totals)
        from_heartbeats = from_heartbeats or worker_instances(*gateway_metrics)
    traced = {(i["role"], i["worker"]) for i in instances}
    untraced = [i for i in from_heartbeats or [] if (i["role"], i["worker"]) not in traced]
    if untraced and not traced:
        instances = untraced
    return {"waterfall": rows, "instances": instances, "ep_ranks": ep_ranks or [],
            "gateway_loop_lag_p99_ms": None if loop_lag_p99_s is None else loop_lag_p99_s * 1e3,
            "verdict": _verdict(rows, instances, loop_lag_p99_s, ep_ranks or [])}


def _instances(by_name: dict[str, list[ReceivedSpan]]) -> list[dict]:
    """Per worker: prefill seconds per prompt token, decode seconds per output token."""
    cost: dict[tuple[str, str], list[float]] = defaultdict(list)
    for s in by_name.get("prefill.compute", []):
        tokens = int(s.attributes.get("gen_ai.usage.input_tokens", 0) or 0) or 1
        cost[("prefill", s.instance or s.service)].append(s.duration_s / tokens)
    for s in by_name.get("decode.generate", []):
        tokens = int(s.attributes.get("gen_ai.usage.output_tokens", 0) or 0)
        if tokens > 1:
            cost[("decode", s.instance or s.service)].append(s.duration_s / tokens)
    out = []
    for role in ("prefill", "decode"):
        workers = {w: statistics.median(v) for (r, w), v in cost.items() if r == role}
        if not workers:
            continue
        peers = against_peers(workers)
        for worker, value in sorted(workers.items()):
            out.append({"role": role, "worker": worker, "ms_per_token": value * 1e3,
                        "vs_peers": peers[worker].vs_peers,
                        "straggler": peers[worker].straggler,
                        "samples": len(cost[(role, worker)])})
    return out


def _verdict(rows: list[dict], instances: list[dict], lag_s: float | None,
             ep_ranks: list[dict]) -> str:
    before = [r for r in rows if r["of"] == "TTFT" and r["share"] is not None
              and r["share"] < 1 and r["phase"] != "unattributed"]
    worst = max(before, key=lambda r: r["share"]) if before else None
    parts = []
    if worst is not None:
        which, ms = ("p50", worst["p50"]) if worst["p50"] is not None else ("mean", worst["mean"])
        parts.append(f"slowest layer before the first token: {worst['phase']} "
                     f"({100 * worst['share']:.0f}% of TTFT {which}, {ms:.1f} ms)")
    slow = sorted((i for i in instances if i.get("straggler")), key=lambda i: -i["vs_peers"])
    if slow:
        parts.append(f"slowest instance: {slow[0]['role']} {slow[0]['worker']}, "
                     f"{slow[0]['ms_per_token']:.2f} ms per token = {slow[0]['vs_peers']:.2f}x "
                     "the median of its peers")
        parts += [f"also slow: {i['role']} {i['worker']} ({i['vs_peers']:.2f}x its peers)"
                  for i in slow[1:]]
    elif instances:
        parts.append(f"no instance stands out (none over {STANDS_OUT:g}x the median of its "
                     "role's other workers)")
    ranks = sorted((r for r in ep_ranks if r.get("straggler")), key=lambda r: -r["vs_group"])
    if ranks:
        rank = ranks[0]
        parts.append(f"slowest EP rank: {rank['group']} {rank['rank']}, MoE compute "
                     f"{rank['moe_compute_ms']:.2f} ms per step = {rank['vs_group']:.2f}x the "
                     f"median of its group's other ranks ({rank['rows_per_step']:.1f} rows per "
                     "step)")
    elif ep_ranks:
        parts.append(f"EP ranks even (no rank's MoE compute over {STANDS_OUT:g}x the median of "
                     "its group's other ranks)")
    if lag_s is not None and lag_s > 0.05:
        parts.append(f"the gateway's event loop lags: p99 {lag_s * 1e3:.0f} ms")
    return "; ".join(parts) or "not enough traces to say"


def _loop_lag_p99(url: str, headers: dict[str, str] | None = None) -> float | None:
    from evenflow.bench.mesh.frontend_bench import lag_buckets, quantile

    buckets = lag_buckets([url + "/metrics"], headers or {})
    if not buckets:
        return None
    return quantile([(le, 0.0) for le, _ in buckets], buckets, 0.99)


def print_report(result: dict) -> None:
    print(f"  {'phase':56} {'p50 ms':>9} {'p99 ms':>9} {'mean ms':>9} {'share':>14}")
    for r in result["waterfall"]:
        p50, p99, mean = ("-" if r.get(k) is None else f"{r[k]:.2f}"
                          for k in ("p50", "p99", "mean"))
        share = "" if r["share"] is None else f"{100 * r['share']:.0f}% of {r['of']}"
        print(f"  {r['phase'][:56]:56} {p50:>9} {p99:>9} {mean:>9} {share:>14}")
    for i in result["instances"]:
        print(f"  {i['role']:7} {i['worker']:8} {i['ms_per_token']:8.3f} ms/token  "
              f"{i['vs_peers']:.2f}x peers ("
              + ("from its heartbeats)" if i.get("source") == "heartbeats"
                 else f"{i['samples']} requests)")
              + ("  <- straggler" if i.get("straggler") else ""))
    for r in result["ep_ranks"]:
        print(f"  EP rank {r['group']}/{r['rank']:6} MoE {r['moe_compute_ms']:7.2f} ms/step, "
              f"collectives {r['moe_wait_ms']:7.2f} ms/step, {r['rows_per_step']:6.1f} rows/step"
              f"  {r['vs_group']:.2f}x group ({r['steps']} steps)"
              + ("  <- straggler" if r.get("straggler") else ""))
    if result["instances"] and not any(i["role"] == "prefill" for i in result["instances"]):
        print("  no prefill worker computed a prompt in the window (a gateway prefills prompts "
              "shorter than its local_prefill_threshold on the decode worker)")
    lag = result["gateway_loop_lag_p99_ms"]
    if lag is not None:
        print(f"  gateway event-loop lag p99: {lag:.1f} ms (bucket bound)")
    print(f"verdict: {result['verdict']}")


def write_png(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (no matplotlib: no PNG; pip install 'evenflow[bench]')")
        return
    rows = [r for r in result["waterfall"] if r["p50"] is not None]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1))
    ax.barh([r["phase"] for r in rows], [r["p50"] for r in rows], color="#1f77b4", label="p50")
    ax.barh([r["phase"] for r in rows], [max(0.0, (r["p99"] or r["p50"]) - r["p50"])
                                         for r in rows],
            left=[r["p50"] for r in rows], color="#ff7f0e", alpha=0.5, label="p99")
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evenflow doctor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=list(WORKLOADS), default="chat")
    ap.add_argument("--model", default=None,
                    help="default: the benchmarks' random 110M Mixtral (4,096 positions)")
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--url", default=None, help="a running mesh's gateway (else: start one)")
    ap.add_argument("--otlp-port", type=int, default=None,
                    help="the trace receiver's port (default: 4318 with --url, else any)")
    ap.add_argument("--otlp-host", default="127.0.0.1")
    ap.add_argument("--flush-wait", type=float, default=6.0,
                    help="--url: seconds to wait for the services' last spans (their batch "
                    "exporters send every 5 s)")
    ap.add_argument("--expert-parallel", type=int, default=1, metavar="N",
                    help="local mesh: every worker a DEP group of N expert-parallel ranks")
    ap.add_argument("--nats", default=None, metavar="URL",
                    help="--url: the mesh's NATS (with rights to read every subject, e.g. "
                    "the admin user's), to read the workers' heartbeats (each one's step "
                    "time per token: the slow instance, with no tracing set up) and EP ranks' "
                    "load reports")
    ap.add_argument("--nats-credentials", default=None, metavar="FILE",
                    help="--nats: a credentials file (`evenflow up` prints its admin one)")
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--png", default=None, metavar="FILE")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    lengths, output_len, requests, concurrency = WORKLOADS[args.workload]
    prompt_lens = prompt_lengths(lengths, requests)

    if args.url:
        receiver = OTLPReceiver(args.otlp_host, 4318 if args.otlp_port is None
                                else args.otlp_port)
        try:
            load, lag, ep_ranks, beats, metrics = _run_against(
                args.url.rstrip("/"), receiver, prompt_lens, output_len, concurrency,
                args.flush_wait, args.nats, args.nats_credentials)
        finally:
            receiver.stop()
        where = f"the mesh at {args.url}"
    else:
        receiver = OTLPReceiver(args.otlp_host, args.otlp_port or 0)
        with scratch_dir("doctor") as scratch:  # (the random checkpoint: removed at the end)
            load, lag, ep_ranks, beats = _run_local(args, receiver, scratch, prompt_lens,
                                                    output_len, concurrency)
        metrics = None
        where = f"{args.prefill} prefill + {args.decode} decode workers"
    result = analyse(receiver.spans, [t.ttft for t in load.timings],
                     [t.e2e for t in load.timings], lag, ep_ranks, beats, metrics)
    result["workload"] = {"name": args.workload, "prompt_tokens": list(lengths),
                          "output_tokens": output_len, "requests": requests,
                          "concurrency": concurrency, "failed": load.errors,
                          "mesh": args.url or "local",
                          "prefill_workers": None if args.url else args.prefill,
                          "decode_workers": None if args.url else args.decode}
    print(f"evenflow doctor: {args.workload} workload, {requests} requests ({load.errors} "
          f"failed), {' / '.join(map(str, sorted(set(lengths))))} -> {output_len} tokens, "
          f"concurrency {concurrency}; "
          f"{where}, {len(receiver.spans)} spans")
    if not receiver.spans:
        print("  no spans arrived (the mesh does not trace to this doctor): the phases come "
              "from the gateway's /metrics, the workers from their heartbeats"
              + ("" if beats else " as the gateway re-exports them")
              + f"; for traces, start the services with "
              f"OTEL_EXPORTER_OTLP_ENDPOINT={receiver.endpoint}")
    if load.first_error:
        print(f"  first failure: {load.first_error}")
    print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(f"written: {args.json}")
    if args.png:
        write_png(result, args.png)
        print(f"written: {args.png}")
    return 0


def _run_local(args: argparse.Namespace, receiver: OTLPReceiver, scratch: Path,
               prompt_lens: list[int], output_len: int, concurrency: int
               ) -> tuple[LoadResult, float | None, list[dict], list[dict]]:
    """A local mesh exporting its spans to `receiver`, the workload through it (the default
    model written under `scratch`)."""
    from evenflow.bench.checkpoint import write_random_mixtral
    from evenflow.services.config import MeshConfig
    from evenflow.services.launcher import LocalMesh

    model = args.model or str(write_random_mixtral(scratch / "mixtral-110m"))
    mesh = LocalMesh(MeshConfig(model=model, port=0, num_prefill=args.prefill,
                                num_decode=args.decode, local_prefill_threshold=0,
                                num_threads=1, kv_cache_gb=0.5, stats_log_interval_s=0,
                                num_ep_ranks=args.expert_parallel if args.expert_parallel > 1
                                else 0, expert_parallel_size=args.expert_parallel))
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    try:
        mesh.start(env=env, health_timeout_s=300)
        from evenflow import models

        model_dir = models.resolve_model(model)
        assert model_dir is not None
        from evenflow.proto.tokenizer import Tokenizer

        vocab = Tokenizer(model_dir).vocab_size  # what the gateway accepts
        prompts = [make_prompts(1, n, vocab, seed=3 + i)[0] for i, n in enumerate(prompt_lens)]
        load, ep_ranks, beats = run_client(_watching_ranks(
            mesh.admin_nats_url or mesh.config.nats_url,
            run_load(mesh.url, mesh.config.model_name, prompts, output_len, concurrency,
                     progress=True)))
        return load, _loop_lag_p99(mesh.url), ep_ranks, beats
    finally:
        mesh.stop()  # the services flush their spans as they exit
        receiver.stop()


def _run_against(url: str, receiver: OTLPReceiver, prompt_lens: list[int], output_len: int,
                 concurrency: int, flush_wait: float, nats_url: str | None,
                 credentials: str | None = None
                 ) -> tuple[LoadResult, float | None, list[dict], list[dict],
                            tuple[Samples, Samples]]:
    """The workload against a running mesh's gateway; its services' spans, if they export to
    `receiver`, arrive meanwhile and up to `flush_wait` s after; the gateway's /metrics before
    and after."""
    import os
    import time

    import httpx

    key = os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    model = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    # token ids the gateway accepts: the tokenizer's own ids for a text of numbers and words
    text = " ".join(str(n) for n in range(400)) + " count from down reverse hello please"
    sample = httpx.post(url + "/tokenize", headers=headers, timeout=30,
                        json={"model": model, "prompt": text}).json()["tokens"]
    ids = sorted(set(sample) - {sample[0]}) if len(set(sample)) > 1 else sample
    # fresh prompts each run: a second run on the same mesh would otherwise find its prompts in
    # the prefix cache (no prefill worker reached, every figure a cache hit's)
    rng = random.Random()
    prompts = [[rng.choice(ids) for _ in range(n)] for n in prompt_lens]
    before = scrape(url, headers)
    load, ep_ranks, beats = run_client(_watching_ranks(nats_url, run_load(
        url, model, prompts, output_len, concurrency, api_key=key, progress=True),
        credentials))
    time.sleep(1.5)  # every worker's next heartbeat (1 s), with the workload's last tokens
    metrics = (before, scrape(url, headers))
    lag = _loop_lag_p99(url, headers)
    time.sleep(flush_wait)
    # A service whose exporter met the receiver before it listened (spans from the mesh's start)
    # retries that batch with backoff for up to its export timeout (10 s) and sends the
    # workload's spans after it: wait up to 20 s (or 3 flush waits) more for the gateway's route
    # spans and a worker's.
    # (none at all, and the workers' heartbeats answered: the mesh does not trace; no wait)
    # (so do the worker figures the gateway re-exports from the heartbeats)
    untraced = (beats or worker_instances(*metrics)) and not receiver.spans
    deadline = time.monotonic() + (0.0 if untraced else max(20.0, 3 * flush_wait))
    while time.monotonic() < deadline:
        names = {(s.service, s.name) for s in receiver.spans}
        if ("evenflow-gateway", "route") in names and \
                {service for service, _ in names} & {"evenflow-prefill", "evenflow-decode"}:
            break
        time.sleep(0.25)
    return load, lag, ep_ranks, beats, metrics


async def _watching_ranks(nats_url: str | None, workload: Coroutine[Any, Any, LoadResult],
                          credentials: str | None = None
                          ) -> tuple[LoadResult, list[dict], list[dict]]:
    """The workload, with the EP ranks' load reports and the workers' heartbeats collected from
    NATS meanwhile (and for one report interval after, so that the last steps are counted)."""
    if nats_url is None:
        return await workload, [], []
    from evenflow.ops.ep_watch import RankLoadWatch, WorkerStepWatch
    from evenflow.services.bus import Bus, NatsSecurity

    bus = Bus("doctor")  # one connection for both watchers
    watch, beats = RankLoadWatch(), WorkerStepWatch()
    await bus.connect(nats_url, security=NatsSecurity(credentials))
    try:
        await watch.attach(bus)
        await beats.attach(bus)
        await asyncio.sleep(1.0)  # every worker's first heartbeat, before the load
        load = await workload
        await asyncio.sleep(1.5)
    finally:
        await bus.close()
    return load, watch.summary(), beats.instances()


if __name__ == "__main__":
    raise SystemExit(main())
