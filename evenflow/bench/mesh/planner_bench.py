"""`evenflow bench planner`: does the SLA planner keep a fleet within its TTFT and ITL targets
while the traffic's mix shifts, against the best fixed split of the same workers, in one run?

The workers are mock workers (evenflow/engine/api/mock.py) whose step costs, and whose start,
are those `evenflow profile-roles` measures from the real engine on this machine (measured at
the start of the run unless `--profile` names a file), times `--timing-scale` (default 40: a
model that much larger; it keeps the mesh's own per-message cost on two shared cores small
against a step), and the engine's construction times `--start-scale` (default 10), which a
mock worker waits out at its start. The planner gets the same profile (Dynamo's planner
plans from profiles too).

The trace (the same Poisson arrivals, seeded, for every configuration): a prefill-heavy phase
(`--long-prompt` tokens in, 8 out), a decode-heavy phase (32 in, `--long-output` out), and the
prefill-heavy phase again, `--phase-s` seconds each. The rates come from the profile: in each
phase the heavy role needs `--heavy` of the workers (0.65 of them by default) and the other
role a little, so no fixed split serves both phases.

Configurations, each on a fresh mesh of `--workers` engine workers:
  fixed P/D      every split, planner off (the best one is the baseline)
  planner        the planner moves a worker by restarting it in the other role (it drains,
                 exits, and the launcher starts it as the other role, weights loaded again):
                 what a fleet without in-place switching can do
  planner+switch the planner switches a worker's role in place (same process and cache)
The planners start from the even split.

A request attains the SLA when it succeeds with TTFT <= the target and its mean ITL (TPOT)
<= the target; goodput is such requests a second. The last line reads
`planner: fixed A%, planner B%, planner+switch C% attainment`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import threading
import time
from dataclasses import dataclass, field, replace

from evenflow.bench.loadgen import REQUEST_ERRORS, make_prompts, one_request, percentile, run_client
from evenflow.bench.sse_client import SSEClient


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds from the trace's start
    phase: int
    prompt: list[int]
    max_tokens: int


@dataclass
class Outcome:
    phase: int
    ttft: float = 0.0
    tpot: float = 0.0
    error: str = ""

    def attains(self, ttft_s: float, itl_s: float) -> bool:
        return not self.error and self.ttft <= ttft_s and self.tpot <= itl_s


@dataclass
class Run:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    moves: int = 0
    seconds: float = 0.0

    def attainment(self, ttft_s: float, itl_s: float, phase: int | None = None) -> float:
        rows = [o for o in self.outcomes if phase is None or o.phase == phase]
        return 100.0 * sum(o.attains(ttft_s, itl_s) for o in rows) / max(1, len(rows))


def make_trace(phases: list[tuple[float, int, int]], phase_s: float, vocab: int, seed: int
               ) -> list[Arrival]:
    """Poisson arrivals per phase: (rate, prompt length, output length)."""
    rng, arrivals, start = random.Random(seed), [], 0.0
    for index, (rate, prompt_len, output_len) in enumerate(phases):
        t = start
        while True:
            t += rng.expovariate(rate)
            if t >= start + phase_s:
                break
            prompt = make_prompts(1, prompt_len, vocab, seed=rng.randrange(1 << 30))[0]
            arrivals.append(Arrival(t, index, prompt, output_len))
        start += phase_s
    return arrivals


async def _play(url: str, model: str, trace: list[Arrival], timeout_s: float
                ) -> list[Outcome]:
    outcomes = [Outcome(a.phase) for a in trace]
    async with SSEClient(url, timeout_s=600, max_idle=1024) as client:
        async def one(i: int, a: Arrival) -> None:
            try:
                timing = await asyncio.wait_for(
                    one_request(client, model, a.prompt, a.max_tokens, {}), timeout_s)
                outcomes[i].ttft, outcomes[i].tpot = timing.ttft, timing.tpot
            except TimeoutError:
                outcomes[i].error = f"not finished within {timeout_s:g} s (given up)"
            except REQUEST_ERRORS as exc:
                outcomes[i].error = str(exc)[:200] or type(exc).__name__

        t0, tasks = time.perf_counter(), []
        for i, a in enumerate(trace):
            delay = t0 + a.at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, a)))
        await asyncio.gather(*tasks)
    return outcomes


def _metric_sum(url: str, name: str, labels: str = "") -> float:
    import httpx

    text = httpx.get(url, timeout=10).text
    pattern = rf"^{name}\{{[^}}]*{labels}[^}}]*\}} (\S+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def run_config(name: str, config: object, trace: list[Arrival], timeout_s: float) -> Run:
    from evenflow.services.launcher import LocalMesh
    from evenflow.services.supervisor import GaveUp, RestartPolicy

    mesh = LocalMesh(config, restart_policy=RestartPolicy(backoff_s=0.2))  # type: ignore[arg-type]
    stop, problems = threading.Event(), []

    def supervise() -> None:
        while not stop.is_set():
            try:
                mesh.supervise(report=lambda m: print(f"    [{name}] {m}", flush=True))
            except GaveUp as exc:
                problems.append(str(exc))
                return
            time.sleep(0.1)

    run = Run(name)
    try:
        mesh.start(health_timeout_s=120)
        threading.Thread(target=supervise, daemon=True).start()
        model = mesh.config.model_name
        warm = [replace(a, at=0.05 * i) for i, a in enumerate(trace[:4])]
        run_client(_play(mesh.url, model, warm, timeout_s))
        t0 = time.perf_counter()
        run.outcomes = run_client(_play(mesh.url, model, trace, timeout_s))
        run.seconds = time.perf_counter() - t0
        planner_url = mesh.metrics_urls().get("plan0")
        if planner_url:
            run.moves = int(_metric_sum(planner_url, "evenflow_planner_decisions_total",
                                        'action="(?:switch|restart)"'))
    finally:
        stop.set()
        mesh.stop()
    if problems:
        print(f"    [{name}] supervisor: {problems[0]}")
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evenflow bench planner", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4, help="engine workers in every config")
    ap.add_argument("--profile", default="", help="a roles profile (`evenflow profile-roles`); "
                                                  "default: measured now")
    ap.add_argument("--timing-scale", type=float, default=40.0)
    ap.add_argument("--start-scale", type=float, default=10.0,
                    help="the engine's construction (a mock worker's start), scaled")
    ap.add_argument("--phase-s", type=float, default=40.0)
    ap.add_argument("--heavy", type=float, default=0.65,
                    help="the share of the workers the heavy role needs in each phase")
    ap.add_argument("--long-prompt", type=int, default=448)
    ap.add_argument("--long-output", type=int, default=256)
    ap.add_argument("--ttft-ms", type=float, default=0.0,
                    help="default: 4x a long prompt's prefill")
    ap.add_argument("--itl-ms", type=float, default=0.0,
                    help="default: a decode step at 24 streams / 0.8")
    ap.add_argument("--interval-s", type=float, default=1.0, help="the planner's interval")
    ap.add_argument("--drain-s", type=float, default=2.0,
                    help="a moved worker's drain bound (then its streams move on)")
    ap.add_argument("--configs", default="fixed,planner,switch",
                    help="which to run: fixed, planner, switch")
    ap.add_argument("--request-timeout-s", type=float, default=30.0,
                    help="a request not finished this long after it was sent is given up "
                         "(counted failed): an overloaded split's backlog ends with the run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-level", default="warning", help="the mesh's (info: the planner's "
                                                          "decisions and the switches)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)

    from evenflow.bench.machine import machine_line, scratch_dir
    from evenflow.planner.policy import max_utilization
    from evenflow.planner.profile import RoleProfile
    from evenflow.services.config import MeshConfig

    print(machine_line("n/a (mock engine, timing model from the real engine's profile)"))
    with scratch_dir("evenflow-planner-bench-") as tmp:
        measured_path = args.profile or os.path.join(tmp, "measured.json")
        if not args.profile:
            from evenflow.bench.offline.role_profile import measure

            found = measure("tiny-moe", 1, 384, [1, 8, 32], 5, 16)
            with open(measured_path, "w") as f:
                json.dump(found, f)
        with open(measured_path) as f:
            measured = json.load(f)
        k = args.timing_scale
        scaled = {key: float(measured[key]) * k for key in (
            "prefill_s_per_token", "decode_s_base", "decode_s_per_seq") if key in measured}
        scaled |= {key: float(measured[key]) * args.start_scale for key in (
            "worker_start_s", "engine_build_s") if key in measured}
        profile_path = os.path.join(tmp, "scaled.json")
        with open(profile_path, "w") as f:
            json.dump(scaled, f)
        profile = RoleProfile.load(profile_path)
        print(f"profile (the real engine, tiny-moe, 1 thread, x{k:g}): prefill "
              f"{profile.prefill_s_per_token * 1e3:.3f} ms/token, decode step "
              f"{profile.decode_s_base * 1e3:.2f} ms + {profile.decode_s_per_seq * 1e3:.3f} "
              f"ms/stream, worker start {profile.worker_start_s:.1f} s (x{args.start_scale:g})")
        service = args.long_prompt * profile.prefill_s_per_token
        ttft_s = args.ttft_ms / 1e3 or 4 * service
        itl_s = args.itl_ms / 1e3 or profile.itl_s(24) / 0.8
        # the rates at which the heavy role needs `heavy` of the workers (policy.py's model)
        heavy = args.heavy * args.workers
        prefill_rate = heavy * max_utilization(service, ttft_s) / service
        streams = (0.8 * itl_s - profile.decode_s_base) / profile.decode_s_per_seq
        decode_rate = heavy * streams / profile.itl_s(streams) / args.long_output
        phases = [(prefill_rate, args.long_prompt, 8), (decode_rate, 32, args.long_output),
                  (prefill_rate, args.long_prompt, 8)]
        trace = make_trace(phases, args.phase_s, 500, args.seed)
        print(f"targets: TTFT {ttft_s * 1e3:.0f} ms, ITL {itl_s * 1e3:.1f} ms; trace: "
              f"{len(trace)} requests, phases of {args.phase_s:g} s: prefill-heavy "
              f"{prefill_rate:.2f}/s ({args.long_prompt} in, 8 out), decode-heavy "
              f"{decode_rate:.2f}/s (32 in, {args.long_output} out), prefill-heavy again")
        base = MeshConfig(port=0, engine="mock", mock_timing_scale=1.0,
                          mock_profile=profile_path, num_ep_ranks=0,
                          local_prefill_threshold=0, max_num_seqs=128, num_kv_blocks=16384,
                          max_inflight=1024, max_queued=4096, heartbeat_interval_s=0.25,
                          stats_log_interval_s=0, log_level=args.log_level, num_gateways=1,
                          ttft_ms=ttft_s * 1e3, itl_ms=itl_s * 1e3,
                          planner_interval_s=args.interval_s, role_switch_drain_s=args.drain_s,
                          planner_profile=profile_path)
        wanted = set(args.configs.split(","))
        total, even = args.workers, args.workers // 2
        configs = []
        if "fixed" in wanted:
            configs += [(f"fixed {p}P/{total - p}D", replace(base, num_prefill=p,
                                                             num_decode=total - p))
                        for p in range(1, total)]
        if "planner" in wanted:
            configs.append(("planner", replace(base, num_prefill=even, num_decode=total - even,
                                               planner=True, planner_mode="restart")))
        if "switch" in wanted:
            configs.append(("planner+switch", replace(
                base, num_prefill=even, num_decode=total - even, planner=True,
                planner_mode="switch")))
        runs = []
        for name, config in configs:
            print(f"  running {name} ...", flush=True)
            runs.append(run_config(name, config, trace, args.request_timeout_s))

    print(f"\n{total} workers; SLA: TTFT <= {ttft_s * 1e3:.0f} ms and mean ITL <= "
          f"{itl_s * 1e3:.1f} ms")
    print(f"  {'config':<16} {'attain':>7} {'ph1':>6} {'ph2':>6} {'ph3':>6} {'goodput/s':>10} "
          f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'failed':>6} "
          f"{'moves':>6}")
    for r in runs:
        ok = [o for o in r.outcomes if not o.error]
        good = sum(o.attains(ttft_s, itl_s) for o in r.outcomes)
        print(f"  {r.name:<16} {r.attainment(ttft_s, itl_s):6.1f}% "
              + " ".join(f"{r.attainment(ttft_s, itl_s, p):5.1f}%" for p in range(3))
              + f" {good / (3 * args.phase_s):10.2f} "
              f"{percentile([o.ttft * 1e3 for o in ok], 50):9.0f} "
              f"{percentile([o.ttft * 1e3 for o in ok], 99):9.0f} "
              f"{percentile([o.tpot * 1e3 for o in ok], 50):8.1f} "
              f"{percentile([o.tpot * 1e3 for o in ok], 99):8.1f} "
              f"{len(r.outcomes) - len(ok):6d} {r.moves:6d}")
        errors = [o.error for o in r.outcomes if o.error]
        if errors:
            print(f"    first error: {errors[0]}")
    print("  (attain: requests within both targets; ph1-3: per phase; goodput: those a second "
          "of the trace; TTFT and ITL (mean per request) in ms; moves: the planner's role "
          "changes)")
    fixed = [r for r in runs if r.name.startswith("fixed")]
    by_name = {r.name: r for r in runs}

    def pct(r: Run | None) -> str:
        return f"{r.attainment(ttft_s, itl_s):.0f}%" if r else "n/a"

    best = max(fixed, key=lambda r: r.attainment(ttft_s, itl_s)) if fixed else None
    print(f"planner: fixed {pct(best)}, planner {pct(by_name.get('planner'))}, planner+switch "
          f"{pct(by_name.get('planner+switch'))} attainment"
          + (f" (best fixed split: {best.name.removeprefix('fixed ')})" if best else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
