"""`evenflow bench frontend`: the gateway alone - how many streams it carries before it becomes
the straggler, and what several gateway processes on one port (`--gateways 1,2`) change.

A local mesh whose workers run the mock engine with its timing model off (zero compute: every
step returns at once), so what is measured is the gateway (HTTP parse, tokenize, route, NATS,
detokenize, SSE write) and the workers' Python around a step. At each concurrency (default 32,
128 and 512 streams), `--requests` streamed completions (1,024, at least 2 x concurrency):
requests/s, output tokens/s streamed, TTFT p50/p99, the gateway's event-loop lag over the run
(p50/p99 from its `evenflow_event_loop_lag_seconds` histogram: how late a 50 ms timer fires), and
the CPU time each kind of process spent per streamed token - the load generator (this process)
included, which on a small machine is often the straggler itself.

A peer's front end on the same load generator: start it yourself and give `--peer-url` (e.g.
vLLM's OpenAI server on its CPU build, serving tiny-moe: `python -m vllm.entrypoints.openai.
api_server --model <evenflow/models/tiny-moe> --dtype bfloat16 --port 8100`); the same streams go
to it at each concurrency and the table prints evenflow's req/s against the peer's. The peer
computes for real, so `--real` gives evenflow real tiny-moe workers too (apples to apples).
Both get one unrecorded warm-up round first.

Peers this bench starts itself, each from its own venv, on the same load generator and streams
(bench/mesh/peers.py): `--vllm-python PATH` (vLLM's OpenAI server over its CPU build, serving
tiny-moe for real: it has no zero-compute mode) and `--dynamo-python PATH` (Dynamo's frontend
over its mocker, zero compute like evenflow's mock). For each, req/s and tok/s at each
concurrency and the CPU each of its processes spent per streamed token, beside evenflow's: the
gateway against vLLM's api server and Dynamo's frontend, the workers' loops against vLLM's
engine core (which computes too) and Dynamo's mocker. A peer that will not start is reported
with the error that stopped it.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable

import httpx

from evenflow.bench.loadgen import make_prompts, percentile, run_client, run_load
from evenflow.bench.machine import bench_checkpoints

_BUCKET = re.compile(r'^evenflow_event_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)$', re.M)


def lag_buckets(metrics_urls: list[str], headers: dict[str, str]) -> list[tuple[float, float]]:
    """The loop-lag histogram's cumulative buckets, summed over these processes' metrics."""
    total: dict[float, float] = {}
    for url in metrics_urls:
        text = httpx.get(url, headers=headers, timeout=30).text
        for le, n in _BUCKET.findall(text):
            bound = float("inf") if le == "+Inf" else float(le)
            total[bound] = total.get(bound, 0.0) + float(n)
    return sorted(total.items())


def quantile(before: list[tuple[float, float]], after: list[tuple[float, float]],
             q: float) -> float:
    """The q-quantile's bucket bound of the samples taken between two scrapes."""
    counts = [(le, b - a) for (le, b), (_, a) in zip(after, before, strict=True)]
    total = counts[-1][1] if counts else 0
    for le, n in counts:
        if total and n >= q * total:
            return le
    return float("nan")


def streamed_requests(args: argparse.Namespace, level: int) -> int:
    """How many streamed requests a row sends at this concurrency (the same for every peer)."""
    return max(2 * level, args.requests)


def cpu_by_role(mesh) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the mesh's processes, by role, and by this
    process (the load generator)."""
    import os

    import psutil

    roles: dict[str, list[int]] = {"client": [os.getpid()]}
    for proc in mesh.procs:
        role = next((a.removeprefix("evenflow.") for a in proc.args
                     if str(a).startswith("evenflow.")), "other")
        roles.setdefault(role, []).append(proc.pid)
    for server in mesh.servers:
        roles.setdefault(server.kind, []).append(server.proc.pid)
    used: dict[str, float] = {}
    for role, pids in roles.items():
        for pid in pids:
            try:
                times = psutil.Process(pid).cpu_times()
            except psutil.Error:  # gone
                continue
            used[role] = used.get(role, 0.0) + times.user + times.system
    return used


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evenflow bench frontend", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="32,128,512")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--decode", type=int, default=2, help="decode workers (mock)")
    ap.add_argument("--prefill", type=int, default=1,
                    help="prefill workers (mock; every prompt goes through one: 0 = none)")
    ap.add_argument("--gateways", default="0",
                    help="gateway process counts to compare, e.g. 0,1,2,4 (each its own mesh; "
                         "0: what `evenflow up` picks on this machine)")
    ap.add_argument("--asgi-stream", action="store_true",
                    help="every SSE event through the request's task and ASGI (the direct "
                         "path off: EVENFLOW_DIRECT_STREAM=0), for A/B")
    ap.add_argument("--requests", type=int, default=1024,
                    help="streamed requests per row, at least 2 x concurrency (non-streamed "
                         "rows: twice as many). A few hundred are over in a tenth of a second, "
                         "and CPU time is read in 10 ms ticks: too few for a steady figure")
    ap.add_argument("--quick", action="store_true", help="concurrency 8 and 32, 16 tokens")
    ap.add_argument("--real", action="store_true",
                    help="workers run tiny-moe for real instead of the zero-compute mock")
    ap.add_argument("--peer-url", default=None,
                    help="an OpenAI-compatible server to drive the same way (its /v1 base URL)")
    ap.add_argument("--peer-model", default=None, help="the peer's model name (default: its "
                    "first /v1/models entry)")
    ap.add_argument("--peer-name", default="peer", help="the peer's name in the table")
    ap.add_argument("--vllm-python", default=None, metavar="PATH",
                    help="start vLLM's OpenAI server from this venv's Python and compare")
    ap.add_argument("--dynamo-python", default=None, metavar="PATH",
                    help="start Dynamo's frontend and one mocker (prefill and decode in one "
                         "worker: compare with --prefill 0 --decode 1) from this venv's Python")
    ap.add_argument("--dynamo-router", default="kv", choices=("kv", "round-robin"),
                    help="Dynamo's router mode: kv (KV-aware from its mocker's KV events, the "
                         "work evenflow's router does) or round-robin (none of it)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    levels = [8, 32] if args.quick else [int(c) for c in args.concurrency.split(",")]
    output_len = 16 if args.quick else args.output_len
    args.requests = 64 if args.quick else args.requests

    from evenflow.bench.machine import machine_line
    from evenflow.services.config import MeshConfig
    from evenflow.services.launcher import LocalMesh

    print(machine_line("tiny-moe, real compute" if args.real else "n/a (mock engine, no compute)"))
    rows = []
    whole_rows: list[tuple[int, int, int, int, float]] = []  # non-streamed, 1 token
    cpu_rows: list[tuple[int, int, dict[str, float]]] = []
    for gateways in (int(g) for g in args.gateways.split(",")):
        config = MeshConfig(port=0, engine="torch" if args.real else "mock",
                            mock_timing_scale=0.0, num_prefill=args.prefill,
                            local_prefill_threshold=0 if args.prefill else 128,
                            num_decode=args.decode, num_ep_ranks=0, max_num_seqs=1024,
                            max_inflight=4096, max_queued=4096, num_kv_blocks=65536,
                            stats_log_interval_s=0, num_gateways=gateways,
                            log_level="warning", direct_stream=not args.asgi_stream)
        gateways = config.gateway_count()
        mesh = LocalMesh(config)
        mesh.start(health_timeout_s=120)
        try:
            urls = [u for name, u in mesh.metrics_urls().items() if name.startswith("gateway")]
            _warm_up(mesh.url, mesh.config.model_name, levels[0], args.prompt_len, output_len)
            for level in levels:
                n = streamed_requests(args, level)
                before = lag_buckets(urls, {})
                cpu_before = cpu_by_role(mesh)
                load = run_client(run_load(mesh.url, mesh.config.model_name,
                                            make_prompts(n, args.prompt_len, 500, seed=level),
                                            output_len, level))
                cpu = {role: used - cpu_before.get(role, 0.0)
                       for role, used in cpu_by_role(mesh).items()}
                after = lag_buckets(urls, {})
                tokens = max(1.0, load.throughput * load.wall)
                cpu_rows.append((gateways, level, {r: 1e6 * c / tokens
                                                   for r, c in sorted(cpu.items())}))
                ttft = [t.ttft * 1e3 for t in load.timings]
                itl = [x * 1e3 for t in load.timings for x in t.itls]
                rows.append((gateways, level, len(load.timings), load.errors,
                             len(load.timings) / load.wall, load.throughput,
                             percentile(ttft, 50), percentile(ttft, 99),
                             percentile(itl, 50), percentile(itl, 99),
                             quantile(before, after, 0.5) * 1e3,
                             quantile(before, after, 0.99) * 1e3))
                whole = run_client(run_load(mesh.url, mesh.config.model_name, make_prompts(
                    2 * n, args.prompt_len, 500, seed=level + 1), 1, level, stream=False))
                whole_rows.append((gateways, level, len(whole.timings), whole.errors,
                                   len(whole.timings) / whole.wall))
        finally:
            mesh.stop()
    workers = "tiny-moe" if args.real else "mock"
    print(f"gateway(s) + {args.decode} {workers} decode workers, prompt "
          f"{args.prompt_len} tokens, {output_len} out, streamed; ratio: req/s against the "
          "first gateway count at the same concurrency")
    print(f"  {'gateways':>8} {'streams':>7} {'ok':>5} {'failed':>6} {'req/s':>8} {'ratio':>6} "
          f"{'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'loop lag p50':>13} {'p99 (ms)':>9}")
    base = {row[1]: row[4] for row in rows if row[0] == rows[0][0]}
    for gateways, level, ok, failed, rps, tps, t50, t99, i50, i99, l50, l99 in rows:
        print(f"  {gateways:8d} {level:7d} {ok:5d} {failed:6d} {rps:8.1f} "
              f"{rps / base[level]:5.2f}x {tps:9.0f} {t50:9.1f} {t99:9.1f} {i50:8.2f} "
              f"{i99:8.2f} {l50:13.1f} {l99:9.1f}")
    print("  (loop lag: bucket upper bounds; TTFT and ITL in ms)")
    print("\nnon-streamed, 1 token out (twice the streamed rows' requests)")
    whole_base = {row[1]: row[4] for row in whole_rows if row[0] == whole_rows[0][0]}
    for gateways, level, ok, failed, rps in whole_rows:
        print(f"  gateways {gateways}, {level:4d} at once: {ok:5d} ok {failed:4d} failed "
              f"{rps:8.1f} req/s {rps / whole_base[level]:5.2f}x")
    print("\nCPU µs per streamed token, by process role (client: this process, the load "
          "generator; the one nearest a full core per token is the straggler)")
    for gateways, level, per_role in cpu_rows:
        cells = "  ".join(f"{role} {us:.0f}" for role, us in per_role.items())
        print(f"  gateways {gateways}, {level:4d} streams:  {cells}")
    if args.peer_url:
        _peer_table(args, levels, output_len, base)
    for python, starter in ((args.vllm_python, "start_vllm"), (args.dynamo_python,
                                                              "start_dynamo")):
        if python:
            _started_peer_table(args, python, starter, levels, output_len, base,
                                {level: per_role for g, level, per_role in cpu_rows
                                 if g == cpu_rows[0][0]}, whole_base)
    return 0


def _started_peer_table(args: argparse.Namespace, python: str, starter: str,
                        levels: list[int], output_len: int, ours: dict[int, float],
                        our_cpu: dict[int, dict[str, float]],
                        whole_ours: dict[int, float]) -> None:
    """A peer this bench starts (bench/mesh/peers.py) under the same streams: req/s, and CPU µs per
    streamed token by its process roles beside evenflow's."""
    from evenflow import models
    from evenflow.bench.mesh import peers
    from evenflow.services.config import MeshConfig

    label = "vLLM" if starter == "start_vllm" else f"Dynamo ({args.dynamo_router} router)"
    model_dir = str(models.resolve_model("tiny-moe"))
    if starter == "start_dynamo":  # (its mocker's token ids are beyond tiny-moe's small
        # vocabulary: they decode to nothing and nothing streams; the 4,096-word benchmark
        # model's tokenizer decodes them, one word a token)

        from evenflow.bench.checkpoint import write_random_mixtral

        model_dir = str(write_random_mixtral(bench_checkpoints()
                                             / "mixtral-110m"))
    try:
        peer = peers.start_vllm(python, model_dir, 2) if starter == "start_vllm" else \
            peers.start_dynamo(python, model_dir, MeshConfig().block_size,
                               router=args.dynamo_router)
    except (peers.PeerError, OSError) as exc:
        print(f"\n{label}: did not start: {exc}")
        return
    try:
        _peer_rows(label, peer.url, peer.model, args, levels, output_len, ours,
                   peer.cpu_by_role, our_cpu, whole_ours)
    finally:
        peer.stop()


def _warm_up(url: str, model: str, level: int, prompt_len: int, output_len: int) -> None:
    """One unrecorded round at the first concurrency: first-call costs (kernel shapes, caches,
    connection set-up) stay out of the table, for evenflow and the peer alike."""
    run_client(run_load(url, model, make_prompts(level, prompt_len, 500, seed=10**6),
                         output_len, level))


def _peer_table(args: argparse.Namespace, levels: list[int], output_len: int,
                ours: dict[int, float]) -> None:
    """The same streams against the peer at --peer-url."""
    base_url = args.peer_url.rstrip("/").removesuffix("/v1")
    model = args.peer_model or httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0][
        "id"]
    _peer_rows(args.peer_name, base_url, model, args, levels, output_len, ours)


def _peer_rows(name: str, url: str, model: str, args: argparse.Namespace, levels: list[int],
               output_len: int, ours: dict[int, float],
               cpu: Callable[[], dict[str, float]] | None = None,
               our_cpu: dict[int, dict[str, float]] | None = None,
               whole_ours: dict[int, float] | None = None) -> None:
    """The same streams against a peer: a row per concurrency with evenflow's req/s (first
    gateway count) / the peer's; with `cpu` (its CPU seconds by process role so far), each
    role's CPU µs per streamed token beside evenflow's gateway and workers."""
    prompt_len = args.prompt_len
    _warm_up(url, model, levels[0], prompt_len, output_len)
    print(f"\n{name} at {url} ({model}), the same load generator and streams")
    print(f"  {'streams':>7} {'ok':>5} {'failed':>6} {'req/s':>8} {'tok/s':>9} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'evenflow / ' + name:>20}")
    for level in levels:
        before = cpu() if cpu else {}
        n = streamed_requests(args, level)
        load = run_client(run_load(url, model, make_prompts(
            n, prompt_len, 500, seed=level), output_len, level))
        ttft = [t.ttft * 1e3 for t in load.timings]
        rps = len(load.timings) / load.wall
        print(f"  {level:7d} {len(load.timings):5d} {load.errors:6d} {rps:8.1f} "
              f"{load.throughput:9.0f} {percentile(ttft, 50):9.1f} {percentile(ttft, 99):9.1f} "
              f"{ours[level] / rps if rps else float('nan'):19.2f}x")
        if cpu:
            tokens = max(1.0, load.throughput * load.wall)
            cells = "  ".join(f"{role} {1e6 * (used - before.get(role, 0.0)) / tokens:.0f}"
                              for role, used in sorted(cpu().items()))
            mine = "  ".join(f"{role} {us:.0f}" for role, us in (our_cpu or {}).get(
                level, {}).items() if role in ("gateway", "decode", "prefill"))
            print(f"          CPU µs per streamed token: {name}: {cells};  evenflow: {mine}")
        if load.first_error:
            print(f"    first error: {load.first_error}")
        if whole_ours:
            whole = run_client(run_load(url, model, make_prompts(
                2 * n, prompt_len, 500, seed=level + 1), 1, level, stream=False))
            wrps = len(whole.timings) / whole.wall
            print(f"          non-streamed, 1 token: {wrps:.1f} req/s ({whole.errors} failed); "
                  f"evenflow / {name}: "
                  f"{whole_ours.get(level, float('nan')) / wrps if wrps else float('nan'):.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
