"""`evenflow bench routing`: round-robin vs least-load vs KV-aware routing on one workload.

A multi-turn chat workload (sessions whose turns extend the previous turn's prompt and answer,
over a few shared system prompts) runs against a fresh local mesh per policy - mock-engine
workers by default (real block managers, prefix caches and KV events; a timing model instead of
the model), or the real default model with `--real`. Printed per policy: prefix hit rate (cached
prompt tokens / prompt tokens) next to the oracle's (each request's longest prefix held anywhere
in the fleet, assuming nothing is evicted), prefill tokens computed, TTFT p50/p90, ITL p99,
throughput, and for `kv` the gateway's mean KV index match time under that load. Then the same
KV-aware run routing from Redis alone: decision p50 / p99 (hashing, match, picking workers) and
hit rate, the gateway's own index copy (kv_index/local_copy.py) against Redis round trips. Then
a workload with no shared prefixes (KV-aware must not cost throughput), the KV index's match
latency for 128 and 1,024 blocks on an idle machine (Redis, and the gateway's copy), and its
write throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from evenflow.bench.loadgen import REQUEST_ERRORS, one_request, percentile, run_client
from evenflow.bench.machine import bench_checkpoints
from evenflow.bench.sse_client import SSEClient
from evenflow.proto.hashing import chain_hashes, namespace_salt


@dataclass
class Workload:
    system_prompts: int = 3
    system_len: int = 256
    sessions: int = 24
    turns: int = 6
    user_len: int = 64  # mean; each turn's length is drawn from [mean/2, 3*mean/2]
    output_len: int = 128  # mean, as user_len
    concurrency: int = 8
    think_ms: float = 50.0  # mean (exponential) pause between a session's turns
    vocab_low: int = 20
    vocab_high: int = 500


@dataclass
class PolicyResult:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    oracle_tokens: int = 0
    output_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)  # decode stalls show in the tail
    wall: float = 0.0
    errors: int = 0
    lookup_s: float | None = None  # mean KV index match at the gateway, under this load
    # routing decision p50 / p99 at the gateway (histogram quantiles), and where its index
    # matches were answered
    decision: tuple[float, float] | None = None
    decision_cpu: tuple[float, float] | None = None  # the same decisions' CPU time
    lookups: dict[str, float] = field(default_factory=dict)


class Oracle:
    """Every full block any request has held so far (prompt and answer), fleet-wide."""

    def __init__(self, block_size: int, salt: bytes) -> None:
        self.block_size, self.salt = block_size, salt
        self.seen: set[int] = set()

    def hit_tokens(self, prompt: list[int]) -> int:
        hits = 0
        for h in chain_hashes(prompt[:-1], self.block_size, self.salt):
            if h not in self.seen:
                break
            hits += 1
        return hits * self.block_size

    def add(self, tokens: list[int]) -> None:
        self.seen.update(chain_hashes(tokens, self.block_size, self.salt))


def varied(rng: random.Random, mean: int) -> int:
    """A length uniform in [mean/2, 3*mean/2]: real turns differ, and equal lengths would keep
    the sessions in lockstep (round-robin would then keep landing a session on one worker)."""
    return rng.randint(max(1, mean // 2), max(1, mean * 3 // 2))


async def run_workload(url: str, model: str, w: Workload, tokenizer, oracle: Oracle,
                       seed: int, multi_turn: bool = True) -> PolicyResult:
    rng = random.Random(seed)
    systems = [[rng.randrange(w.vocab_low, w.vocab_high) for _ in range(w.system_len)]
               for _ in range(w.system_prompts)]
    result = PolicyResult()
    sessions: asyncio.Queue[int] = asyncio.Queue()
    for s in range(w.sessions):
        sessions.put_nowait(s)

    async def session(client: SSEClient, s: int) -> None:
        srng = random.Random(seed * 1000 + s)
        history = list(systems[s % w.system_prompts])
        for _ in range(w.turns):
            if not multi_turn:  # every turn a fresh prompt of the same mean length
                history = []
            user_len = varied(srng, w.user_len if multi_turn else w.system_len + w.user_len)
            user = [srng.randrange(w.vocab_low, w.vocab_high) for _ in range(user_len)]
            prompt = history + user
            oracle_hit = oracle.hit_tokens(prompt)
            try:
                t = await one_request(client, model, prompt, varied(srng, w.output_len), {})
            except REQUEST_ERRORS:
                result.errors += 1
                return
            answer = tokenizer.encode(t.text, add_special_tokens=False)
            result.oracle_tokens += oracle_hit
            oracle.add(prompt + answer)
            result.ttfts.append(t.ttft)
            result.itls.extend(t.itls)
            result.prompt_tokens += t.prompt_tokens
            result.cached_tokens += t.cached_tokens
            result.output_tokens += t.output_tokens
            history = prompt + answer
            if w.think_ms > 0:
                await asyncio.sleep(srng.expovariate(1000.0 / w.think_ms))

    async def worker(client: SSEClient) -> None:
        while not sessions.empty():
            await session(client, sessions.get_nowait())

    async with SSEClient(url, timeout_s=120) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(w.concurrency)))
        result.wall = time.perf_counter() - start
    return result


def run_policy(policy: str, args: argparse.Namespace, w: Workload,
               multi_turn: bool, local_copy: bool = True) -> PolicyResult:
    from evenflow.proto.tokenizer import Tokenizer
    from evenflow.services.config import MeshConfig
    from evenflow.services.launcher import LocalMesh

    overrides = {key: value for key, value in (
        ("local_prefill_threshold", args.local_prefill_threshold),
        ("kv_overlap_weight", args.kv_overlap_weight),
        ("decode_load_weight", args.decode_load_weight)) if value is not None}
    config = MeshConfig(port=0, model=args.model, engine="torch" if args.real else "mock",
                        router=policy, num_prefill=args.prefill, num_decode=args.decode,
                        kv_cache_gb=0.25, num_threads=1,
                        kv_index_local_copy=local_copy, **overrides)
    mesh = LocalMesh(config)
    mesh.start(health_timeout_s=300)
    try:
        from evenflow import models

        model_dir = models.resolve_model(args.model)
        assert model_dir is not None
        tokenizer = Tokenizer(model_dir)
        oracle = Oracle(config.block_size, namespace_salt(model_dir.name))
        result = run_client(run_workload(mesh.url, config.model_name, w, tokenizer, oracle,
                                          seed=1, multi_turn=multi_turn))
        result.lookup_s = mean_lookup_seconds(mesh.url)
        result.decision, result.lookups = decision_figures(mesh.url)
        result.decision_cpu = decision_figures(mesh.url,
                                               "evenflow_route_decision_cpu_seconds")[0]
        return result
    finally:
        mesh.stop()


def mean_lookup_seconds(url: str) -> float | None:
    """The gateway's mean KV index match time, from its Prometheus histogram."""
    text = httpx.get(url + "/metrics", timeout=10).text
    found = {name: float(value) for name, value in re.findall(
        r"^evenflow_kv_lookup_seconds_(sum|count) (\S+)$", text, re.MULTILINE)}
    return found["sum"] / found["count"] if found.get("count") else None


def decision_figures(url: str, metric: str = "evenflow_route_decision_seconds"
                     ) -> tuple[tuple[float, float] | None, dict[str, float]]:
    """The gateway's routing decision p50 / p99 over every decision (`metric`: their wall
    time, or `evenflow_route_decision_cpu_seconds`, their CPU time), wherever its index match
    was answered (interpolated in its histogram's buckets, as Prometheus' histogram_quantile
    does, summed over the `index` label), and its index matches by source."""
    text = httpx.get(url + "/metrics", timeout=10).text
    summed: dict[float, float] = {}
    for le, n in re.findall(rf'^{metric}_bucket\{{index="\w+",'
                            r'le="([^"]+)"\} (\S+)$', text, re.MULTILINE):
        bound = float("inf") if le == "+Inf" else float(le)
        summed[bound] = summed.get(bound, 0.0) + float(n)
    buckets = sorted(summed.items())
    sources = {src: float(n) for src, n in re.findall(
        r'^evenflow_kv_lookups_total\{source="(\w+)"\} (\S+)$', text, re.MULTILINE)}
    if not buckets or not buckets[-1][1]:
        return None, sources
    return (histogram_quantile(buckets, 0.5), histogram_quantile(buckets, 0.99)), sources


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """q-quantile of cumulative (upper bound, count) buckets, linear inside a bucket."""
    total = buckets[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def local_match_latency(blocks: int, members: int = 16, calls: int = 300
                        ) -> tuple[float, float]:
    """p50 / p99 seconds of the gateway's own index copy answering the same match as
    match_latency (the same members holding the same shares)."""
    from evenflow.kv_index.local_copy import LocalIndex
    from evenflow.proto.messages import KVSnapshot, Role

    hashes = chain_hashes(list(range(blocks * 16)), 16)
    index = LocalIndex()
    live = {f"w{m}": "e" for m in range(members)}
    for m in range(members):
        index.apply(KVSnapshot(worker_id=f"w{m}", role=Role.DECODE, epoch="e", seq=0,
                               block_hashes=hashes[: blocks * (m + 1) // members]))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        got = index.match(hashes, live)
        times.append(time.perf_counter() - t0)
    assert max(got.values()) == blocks
    return percentile(times, 50), percentile(times, 99)


async def match_latency(blocks: int, members: int = 16,
                        calls: int = 300) -> tuple[float, float, float]:
    """p50 / p99 seconds of one KVIndexClient.match over `blocks` hashes, `members` workers each
    holding a different share of the chain, against a real redis-server; and the p50 of the
    whole decision input (hashing the prompt's tokens, then the match)."""
    from evenflow.kv_index import store
    from evenflow.kv_index.client import KVIndexClient
    from evenflow.services.launcher import start_redis

    server = start_redis()
    try:
        keys = store.Keys("ev:bench:default:")
        client = KVIndexClient(server.url, keys)
        hashes = chain_hashes(list(range(blocks * 16)), 16)
        pipe = client.redis.pipeline(transaction=False)
        for m in range(members):
            member = store.member_of(f"w{m}", "e")
            for h in hashes[: blocks * (m + 1) // members]:
                pipe.sadd(keys.block_key(h), member)
            pipe.zadd(keys.leases, {member: time.time() + 3600})
        await pipe.execute()
        tokens = list(range(blocks * 16))
        times, with_hashing = [], []
        for _ in range(calls):
            t0 = time.perf_counter()
            got = await client.match(hashes)
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await client.match(chain_hashes(tokens, 16))
            with_hashing.append(time.perf_counter() - t0)
        assert max(got.values()) == blocks
        await client.close()
        return percentile(times, 50), percentile(times, 99), percentile(with_hashing, 50)
    finally:
        server.stop()


async def write_throughput(events: int = 50_000, per_message: int = 100) -> float:
    """Block events per second through NATS and the kv_index service into Redis."""
    import nats

    from evenflow.kv_index import store
    from evenflow.proto import subjects
    from evenflow.proto.messages import BlockStored, KVEvents, Role, encode
    from evenflow.services.config import MeshConfig
    from evenflow.services.launcher import start_nats, start_redis, stop_process

    nats_server, redis_server = start_nats(), start_redis()
    config = MeshConfig(nats_url=nats_server.url, redis_url=redis_server.url)
    env = {**config.to_env(), "PATH": ""}
    proc = subprocess.Popen([sys.executable, "-m", "evenflow.kv_index", "kvbench"], env=env,
                            stderr=subprocess.DEVNULL)
    try:
        import redis.asyncio as aioredis

        r = aioredis.Redis.from_url(redis_server.url)
        nc = await nats.connect(nats_server.url)
        await asyncio.sleep(2.0)  # let the service subscribe
        hashes = chain_hashes(list(range(events * 16)), 16)
        start = time.perf_counter()
        for seq, first in enumerate(range(0, events, per_message), start=1):
            batch = hashes[first : first + per_message]
            await nc.publish(subjects.KV_EVENTS, encode(KVEvents(
                worker_id="bench", role=Role.PREFILL, epoch="e1", seq=seq,
                events=[BlockStored(block_hashes=batch)])))
        await nc.flush()
        member = store.member_of("bench", "e1")
        keys = store.Keys(config.redis_prefix)
        while not await r.sismember(keys.block_key(hashes[-1]), member):
            await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - start
        await nc.close()
        await r.aclose()
        return events / elapsed
    finally:
        stop_process(proc, timeout_s=30)  # a starved machine may take a while; then kill
        nats_server.stop()
        redis_server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evenflow bench routing", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", action="store_true", help="the real default model (2 prefill "
                    "workers + 1 decode) instead of mock workers")
    ap.add_argument("--model", default=None,
                    help="default: tiny-moe with --real; a small random checkpoint (4,096 "
                    "positions, word-level tokenizer) for the mock workers")
    ap.add_argument("--prefill", type=int, default=None, help="prefill workers (mock: 4)")
    ap.add_argument("--decode", type=int, default=None, help="decode workers (mock: 2)")
    ap.add_argument("--local-prefill-threshold", type=int, default=None,
                    help="default: the mesh's (EVENFLOW_LOCAL_PREFILL_THRESHOLD)")
    ap.add_argument("--kv-overlap-weight", type=float, default=None,
                    help="the router's w (default: the mesh's, EVENFLOW_KV_OVERLAP_WEIGHT)")
    ap.add_argument("--decode-load-weight", type=float, default=None,
                    help="blocks one running decode sequence counts as (default: the mesh's)")
    ap.add_argument("--sessions", type=int, default=None, help="default: 24 (--quick: 4)")
    ap.add_argument("--turns", type=int, default=None)
    ap.add_argument("--system-len", type=int, default=None)
    ap.add_argument("--user-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--think-ms", type=float, default=None)
    ap.add_argument("--policies", default="round_robin,least_load,kv")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.model is None:

        from evenflow.bench.checkpoint import QUICK_MODEL, write_random_mixtral

        # Mock workers never run the weights: a long context costs nothing.
        args.model = "tiny-moe" if args.real else str(write_random_mixtral(
            bench_checkpoints() / "mixtral-quick-4k",
            {**QUICK_MODEL, "max_position_embeddings": 4096}))
    if args.prefill is None:
        args.prefill = 2 if args.real else 4
    if args.decode is None:
        args.decode = 1 if args.real else 2
    w = Workload()
    if args.real:  # tiny-moe has 512 positions
        w = Workload(system_len=128, user_len=32, output_len=16, turns=4)
    if args.quick:
        w = Workload(system_len=64, user_len=16, output_len=8, sessions=4, turns=2,
                     concurrency=2)
    fields = ("sessions", "turns", "system_len", "user_len", "output_len", "concurrency",
              "think_ms")
    overrides = {k: getattr(args, k) for k in fields if getattr(args, k) is not None}
    w = dataclasses.replace(w, **overrides)
    policies = args.policies.split(",")
    print(f"workload: {w.sessions} sessions x {w.turns} turns over {w.system_prompts} system "
          f"prompts of {w.system_len} tokens; user {w.user_len}, answer {w.output_len} tokens; "
          f"concurrency {w.concurrency}")
    print(f"fleet: {args.prefill} prefill + {args.decode} decode workers "
          f"({'real ' + args.model if args.real else 'mock engine'})\n")
    results = {p: run_policy(p, args, w, True) for p in policies}
    print(f"{'policy':12} {'hit rate':>9} {'oracle':>7} {'of oracle':>9} {'prefill tok':>11} "
          f"{'TTFT p50':>9} {'TTFT p90':>9} {'ITL p99':>9} {'tok/s':>8} {'errors':>6} "
          f"{'match avg':>9}")
    for p, r in results.items():
        hit = r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0
        oracle = r.oracle_tokens / r.prompt_tokens if r.prompt_tokens else 0
        print(f"{p:12} {hit:9.3f} {oracle:7.3f} {hit / oracle if oracle else 0:9.2f} "
              f"{r.prompt_tokens - r.cached_tokens:11d} {percentile(r.ttfts, 50) * 1e3:8.1f}ms "
              f"{percentile(r.ttfts, 90) * 1e3:8.1f}ms {percentile(r.itls, 99) * 1e3:7.1f}ms "
              f"{r.output_tokens / r.wall:8.1f} {r.errors:6d} "
              f"{'-' if r.lookup_s is None else f'{r.lookup_s * 1e3:.2f}ms':>9}")
    if "kv" in results:  # the same workload, routing from Redis alone
        redis_only = run_policy("kv", args, w, True, local_copy=False)
        print("\nKV-aware routing decisions under this load (hashing, index match, picking "
              "the workers), the gateway's own index copy vs Redis only; wall time, and the "
              "gateway thread's CPU time (the wall time also holds waits for a core)")
        print(f"{'index':12} {'hit rate':>9} {'decision p50':>13} {'p99':>9} {'CPU p50':>9} "
              f"{'p99':>9} {'from copy':>10} {'from Redis':>11}")
        for name, r in (("local copy", results["kv"]), ("Redis only", redis_only)):
            hit = r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0
            p50, p99 = r.decision or (0.0, 0.0)
            c50, c99 = r.decision_cpu or (0.0, 0.0)
            print(f"{name:12} {hit:9.3f} {p50 * 1e3:11.3f}ms {p99 * 1e3:7.3f}ms "
                  f"{c50 * 1e3:7.3f}ms {c99 * 1e3:7.3f}ms "
                  f"{r.lookups.get('local', 0):10.0f} {r.lookups.get('redis', 0):11.0f}")
    if "round_robin" in results and "kv" in results:
        rr, kv = results["round_robin"], results["kv"]
        ttft_ratio = percentile(kv.ttfts, 50) / percentile(rr.ttfts, 50)
        print(f"\nKV-aware vs round-robin: TTFT p50 {ttft_ratio:.2f}x, "
              f"throughput {kv.output_tokens / kv.wall / (rr.output_tokens / rr.wall):.2f}x")
    if not args.quick and {"least_load", "kv"} <= set(policies):
        flat = {p: run_policy(p, args, w, False) for p in ("least_load", "kv")}
        ll, kv = flat["least_load"], flat["kv"]
        kv_rate, ll_rate = kv.output_tokens / kv.wall, ll.output_tokens / ll.wall
        print(f"no shared prefixes ({w.sessions * w.turns} unrelated prompts of "
              f"~{w.system_len + w.user_len} tokens): throughput kv {kv_rate:.1f} "
              f"vs least-load {ll_rate:.1f} tok/s ({kv_rate / ll_rate:.2f}x)")
    print("\nKV index (16 workers in the index, real redis-server):")
    for blocks in (128, 1024):
        p50, p99, hashed = asyncio.run(match_latency(blocks))
        print(f"  match {blocks:5d} blocks: p50 {p50 * 1e3:.3f} ms  p99 {p99 * 1e3:.3f} ms  "
              f"(hashing the {blocks * 16:,} tokens + match: p50 {hashed * 1e3:.3f} ms)")
        p50, p99 = local_match_latency(blocks)
        print(f"  the gateway's own copy, {blocks:5d} blocks: p50 {p50 * 1e3:.3f} ms  "
              f"p99 {p99 * 1e3:.3f} ms")
    rate = asyncio.run(write_throughput(10_000 if args.quick else 50_000))
    print(f"  write throughput (NATS -> kv_index -> Redis): {rate:,.0f} block events/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
