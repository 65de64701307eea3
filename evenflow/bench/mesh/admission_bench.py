"""`evenflow bench admission`: request priority and tenant fairness under overload, each against
a baseline measured in the same run.

A local mesh of mock workers whose timing model is on (a step costs what a small GPU's would,
evenflow/engine/api/mock.py: capacity is finite), one decode worker (local prefill), and a
gateway that runs as many requests as the worker batches (`--slots`), so overload waits in the
gateway's admission queue (gateway/admission.py) and, past it, in the engine's waiting queue
(engine/core/scheduler.py). Tenants come from a header (EVENFLOW_TENANT_HEADER=x-tenant).

1. Capacity: a closed loop at twice the slots measures the mesh's completions per second.
2. Priority: high-priority requests (priority -1) alone, Poisson at a fifth of capacity: their
   TTFT p99 unloaded. Then the same stream with low-priority requests (priority 1) beside it,
   Poisson, the two adding up to twice capacity: the high ones' TTFT p99 against unloaded
   (target within 2x) and how many low ones completed (target: all).
3. Fairness: tenant B alone, Poisson at half of capacity (its share of two equal tenants): its
   goodput, DistServe's and Dynamo's sense: requests served within the TTFT objective
   (`--ttft-slo-ms`, 1 s) per second of its arrivals. Then with tenant A flooding at 10x its
   share, and again with the tenant header off (one FIFO for both): B's goodput against alone
   (target >= 0.9 with tenants). Completions a second (its first arrival to its last
   completion) are shown too.

The last line: `admission: high-priority TTFT p99 X.XXx unloaded at 2x overload (low-priority
N/N completed); tenant B goodput Y.YY of alone with A at 10x its share (FIFO: Z.ZZ)`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, field

from evenflow.bench.loadgen import (
    REQUEST_ERRORS,
    make_prompts,
    one_request,
    percentile,
    run_client,
)
from evenflow.bench.sse_client import SSEClient


@dataclass
class Stream:
    """One class of traffic: its body extras and headers, Poisson at `rate` (or closed-loop
    at `concurrency` when rate is 0), `count` requests."""

    name: str
    count: int
    rate: float = 0.0
    concurrency: int = 0
    extra: dict = field(default_factory=dict)
    headers: dict = field(default_factory=dict)
    ttfts: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str = ""
    started: float = 0.0
    finished: float = 0.0

    @property
    def ok(self) -> int:
        return len(self.ttfts)

    def done_per_s(self) -> float:
        """Completions a second, from its first arrival to its last completion."""
        return self.ok / max(1e-9, self.finished - self.started)

    def goodput(self, slo_s: float) -> float:
        """Requests served within the TTFT objective, per second of its arrivals (a closed
        loop's: per second of its run)."""
        window = self.count / self.rate if self.rate > 0 else self.finished - self.started
        return sum(t <= slo_s for t in self.ttfts) / max(1e-9, window)


async def _drive(url: str, model: str, streams: list[Stream], prompt_len: int, output_len: int,
                 seed: int) -> None:
    async with SSEClient(url, timeout_s=300, max_idle=512) as client:
        async def one(stream: Stream, prompt: list[int]) -> None:
            try:
                timing = await one_request(client, model, prompt, output_len, stream.headers,
                                           stream.extra)
                stream.ttfts.append(timing.ttft)
            except REQUEST_ERRORS as exc:
                stream.errors += 1
                stream.first_error = stream.first_error or str(exc)[:160]
            stream.finished = max(stream.finished, time.perf_counter())

        async def run(stream: Stream, index: int) -> None:
            rng = random.Random(seed + index)
            prompts = make_prompts(stream.count, prompt_len, 500, seed=seed * 7 + index)
            stream.started = time.perf_counter()
            if stream.rate > 0:
                tasks = []
                for prompt in prompts:
                    tasks.append(asyncio.create_task(one(stream, prompt)))
                    await asyncio.sleep(rng.expovariate(stream.rate))
                await asyncio.gather(*tasks)
                return
            gate = asyncio.Semaphore(stream.concurrency)

            async def gated(prompt: list[int]) -> None:
                async with gate:
                    await one(stream, prompt)

            await asyncio.gather(*(gated(p) for p in prompts))

        await asyncio.gather(*(run(s, i) for i, s in enumerate(streams)))


def _mesh(args: argparse.Namespace, tenants: bool):
    from evenflow.services.config import MeshConfig
    from evenflow.services.launcher import LocalMesh

    config = MeshConfig(port=0, engine="mock", mock_timing_scale=args.timing_scale,
                        num_prefill=0, local_prefill_threshold=1 << 20, num_decode=1,
                        num_ep_ranks=0, max_num_seqs=args.slots, max_inflight=args.slots,
                        max_queued=4096, num_kv_blocks=65536, stats_log_interval_s=0,
                        tenant_header="x-tenant" if tenants else "", log_level="warning")
    mesh = LocalMesh(config)
    mesh.start(health_timeout_s=120)
    return mesh


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evenflow bench admission", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=16,
                    help="requests the gateway runs and the worker batches at once")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=4.0,
                    help="how long each overloaded phase sends for")
    ap.add_argument("--ttft-slo-ms", type=float, default=1000.0,
                    help="the TTFT objective a request must meet to count in goodput")
    ap.add_argument("--timing-scale", type=float, default=1.0,
                    help="the mock's step times, scaled (1: as its model says)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)

    from evenflow.bench.machine import machine_line

    print(machine_line("n/a (mock engine, timing model on)"))
    length = dict(prompt_len=args.prompt_len, output_len=args.output_len)
    mesh = _mesh(args, tenants=True)
    try:
        url, model = mesh.url, mesh.config.model_name
        run_client(_drive(url, model, [Stream("warm", 2 * args.slots,
                                              concurrency=args.slots)], seed=0, **length))
        probe = Stream("capacity", 8 * args.slots, concurrency=2 * args.slots)
        run_client(_drive(url, model, [probe], seed=1, **length))
        capacity = probe.done_per_s()
        high_rate = capacity / 5
        n_high = max(20, int(high_rate * args.seconds))
        alone = Stream("high alone", n_high, rate=high_rate, extra={"priority": -1})
        run_client(_drive(url, model, [alone], seed=2, **length))
        n_low = int(2 * capacity * args.seconds) - n_high
        high = Stream("high", n_high, rate=high_rate, extra={"priority": -1})
        low = Stream("low", n_low, rate=2 * capacity - high_rate, extra={"priority": 1})
        run_client(_drive(url, model, [high, low], seed=3, **length))
        b_rate = capacity / 2
        n_b = max(20, int(b_rate * args.seconds))

        def tenant_b() -> Stream:
            return Stream("B", n_b, rate=b_rate, headers={"x-tenant": "B"})

        def tenant_a() -> Stream:
            return Stream("A", int(10 * b_rate * args.seconds), rate=10 * b_rate,
                          headers={"x-tenant": "A"})

        b_alone = tenant_b()
        run_client(_drive(url, model, [b_alone], seed=4, **length))
        b_shared, a_flood = tenant_b(), tenant_a()
        run_client(_drive(url, model, [b_shared, a_flood], seed=5, **length))
    finally:
        mesh.stop()
    fifo = _mesh(args, tenants=False)  # the same streams, one queue for both
    try:
        run_client(_drive(fifo.url, fifo.config.model_name,
                          [Stream("warm", 2 * args.slots, concurrency=args.slots)],
                          seed=0, **length))
        b_fifo, a_fifo = tenant_b(), tenant_a()
        run_client(_drive(fifo.url, fifo.config.model_name, [b_fifo, a_fifo], seed=5,
                          **length))
    finally:
        fifo.stop()

    slo = args.ttft_slo_ms / 1e3

    def p99(stream: Stream) -> float:
        return percentile([t * 1e3 for t in stream.ttfts], 99)

    print(f"one mock decode worker, {args.slots} slots (gateway and batch), prompt "
          f"{args.prompt_len}, {args.output_len} out, streamed; capacity {capacity:.1f} "
          "completions/s (closed loop at twice the slots)")
    print(f"  {'phase':<44} {'stream':<6} {'sent':>5} {'ok':>5} {'failed':>6} "
          f"{'TTFT p50':>9} {'TTFT p99':>9} {'done/s':>7} {'goodput/s':>10}")
    rows = [("priority: high alone at 0.2x capacity", alone),
            ("priority: high + low at 2x capacity", high),
            ("", low), ("fairness: B alone at its share (0.5x)", b_alone),
            ("fairness: B + A at 10x its share, tenants", b_shared), ("", a_flood),
            ("fairness: the same, one FIFO (no tenants)", b_fifo), ("", a_fifo)]
    for phase, s in rows:
        print(f"  {phase:<44} {s.name:<6} {s.count:5d} {s.ok:5d} {s.errors:6d} "
              f"{percentile([t * 1e3 for t in s.ttfts], 50):9.1f} {p99(s):9.1f} "
              f"{s.done_per_s():7.1f} {s.goodput(slo):10.1f}")
        if s.first_error and s.name in ("high", "B"):
            print(f"    first error: {s.first_error}")
    ratio = p99(high) / p99(alone)
    share = b_shared.goodput(slo) / b_alone.goodput(slo)
    share_fifo = b_fifo.goodput(slo) / b_alone.goodput(slo)
    print(f"  (TTFT in ms; done/s: completions a second from the stream's first arrival to its "
          f"last completion; goodput/s: requests with TTFT <= {args.ttft_slo_ms:.0f} ms per "
          "second of arrivals)")
    print(f"admission: high-priority TTFT p99 {ratio:.2f}x unloaded at 2x overload "
          f"(low-priority {low.ok}/{low.count} completed); tenant B goodput {share:.2f} of "
          f"alone with A at 10x its share (FIFO: {share_fifo:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
