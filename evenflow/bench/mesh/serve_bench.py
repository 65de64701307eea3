"""`evenflow bench serve`: load through the gateway, and what the mesh costs.

1. Offline baseline, in this process: the engine alone (one thread, like a worker) - TTFT of
   512-token prompts, TPOT at batch 1 and 16.
2. The same through a local mesh it starts (gateway + 1 prefill + 1 decode worker, every prompt
   disaggregated): TTFT p50 and TPOT at concurrency 1 and 16 -> mesh overhead and ratios.
   1. and 2. alternate run by run (offline, mesh, offline, ...): this host's speed drifts by
   several percent over the minutes a run takes, more than the overhead being measured.
3. KV-transfer bandwidth prefill -> decode (decode workers' counters: bytes / (export start ->
   transfer complete)) next to raw NATS publish bandwidth for the same bytes in the same chunks.
4. A load run (concurrency, prompt and output lengths, shared prefix) printing TTFT, TPOT and ITL
   p50/p90/p99 and throughput.
The default model is the random ~110M Mixtral of `bench engine` (4,096 positions); `--model
tiny-moe` works with prompts under 512 tokens.

`--base-url URL` runs only the load (4.) against any OpenAI-compatible server - vLLM's, Dynamo's
or a running `evenflow up` - with `--request-rate` (Poisson arrivals) and `--concurrency`;
`--json FILE` and `--plot DIR` (TTFT / ITL CDFs, throughput over time) work in both modes.
5. The one-message K/V hand-off against a chunk and a completion: the batch-16 first gap on two
   meshes, alternating (bench/mesh/handoff_bench.py).
6. A chat's next turn with its history pulled from the decode worker against recomputed: TTFT
   p50 at 256 / 1,024 / 2,048 tokens of history and the measured crossover, two meshes
   alternating (bench/mesh/pull_bench.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from evenflow.bench.loadgen import (
    LoadResult,
    RequestTiming,
    make_prompts,
    one_request,
    result_json,
    run_client,
    run_load,
    summary_rows,
    write_plots,
)
from evenflow.bench.machine import machine_line, scratch_dir
from evenflow.bench.sse_client import SSEClient


class OfflineEngine:
    """The engine alone, in this process (one thread, like a worker), timed the way the mesh
    is: TTFT from adding a request to its first token, TPOT as the median step after it."""

    def __init__(self, model: str) -> None:
        from evenflow.engine.serving.engine import Engine, EngineConfig

        self.engine = Engine(EngineConfig(model=model, num_threads=1, kv_cache_gb=0.5))
        self.vocab = self.engine.model_config.vocab_size
        self._ids = iter(range(10**9))
        self.run(make_prompts(2, 64, self.vocab, seed=99), 2)  # warm-up

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[float]]:
        """(seconds to the first token, seconds of each step) for these prompts at once."""
        from evenflow.proto.sampling import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        for p in prompts:
            self.engine.add_request(str(next(self._ids)), p, params)
        first, times = None, []
        while self.engine.has_unfinished():
            t0 = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - t0)
            if first is None:
                first = time.perf_counter() - start
        return first or 0.0, times


async def interleaved_overhead(offline: OfflineEngine, url: str, model: str, prompt_len: int,
                               reps: int, out_len: int, tpot_rounds: tuple[int, int] = (3, 2)
                               ) -> tuple[dict, dict, int]:
    """TTFT and TPOT of the engine alone and through the mesh, measured in alternation (one
    offline run, then one through the mesh, and again) so that the machine's drift over the
    minutes a run takes falls on both alike; the mesh runs share one HTTP client (kept-alive
    connections, as the old all-mesh-at-once runs had). -> (offline, mesh, failed requests)."""
    vocab, failed = offline.vocab, 0
    async with SSEClient(url, timeout_s=300) as client:

        async def mesh_run(prompts: list[list[int]], max_tokens: int) -> list[RequestTiming]:
            nonlocal failed
            outcomes = await asyncio.gather(
                *(one_request(client, model, p, max_tokens, {}) for p in prompts),
                return_exceptions=True)
            failed += sum(isinstance(o, BaseException) for o in outcomes)
            return [o for o in outcomes if isinstance(o, RequestTiming)]

        await mesh_run(make_prompts(2, prompt_len, vocab, seed=98), 2)  # warm-up
        offline.run(make_prompts(1, prompt_len, vocab, seed=97), 1)
        keys = ("ttft", "tpot1", "tpot16", "gap16", "rest16")
        times: dict[str, dict[str, list[float]]] = {
            "offline": {key: [] for key in keys}, "mesh": {key: [] for key in keys}}
        for r in range(reps):  # (the offline runs block this loop: the mesh is idle then)
            times["offline"]["ttft"].append(
                offline.run(make_prompts(1, prompt_len, vocab, seed=100 + r), 1)[0])
            times["mesh"]["ttft"] += [t.ttft for t in await mesh_run(
                make_prompts(1, prompt_len, vocab, seed=200 + r), 2)]
        for batch, key, rounds in ((1, "tpot1", tpot_rounds[0]), (16, "tpot16", tpot_rounds[1])):
            for r in range(rounds):
                steps = offline.run(
                    make_prompts(batch, 128, vocab, seed=300 + 10 * batch + r), out_len)[1]
                timings = await mesh_run(
                    make_prompts(batch, 128, vocab, seed=400 + 10 * batch + r), out_len)
                times["offline"][key] += steps[1:]
                times["mesh"][key] += [t.tpot for t in timings]
                if batch == 16 and out_len >= 3:  # TPOT = the first gap + the ones after it
                    times["offline"]["gap16"].append(steps[1])
                    times["offline"]["rest16"] += steps[2:]
                    times["mesh"]["gap16"] += [t.itls[0] for t in timings if len(t.itls) > 1]
                    times["mesh"]["rest16"] += [statistics.fmean(t.itls[1:]) for t in timings
                                                if len(t.itls) > 1]
    medians = {side: {key: statistics.median(values) if values else float("nan")
                      for key, values in by_key.items()} for side, by_key in times.items()}
    return medians["offline"], medians["mesh"], failed


def busy_neighbour_tpot(offline: OfflineEngine, out_len: int, rounds: int = 2
                        ) -> tuple[float, float, int]:
    """The engine alone at batch 16 with the machine's other CPUs idle, then with a spinning
    Python process on each (alternating, medians) -> (idle s, busy s, spinners). A mesh must
    run its gateway, NATS and client somewhere while a decode worker steps; where CPUs share a
    physical core (SMT siblings, a VM's vCPUs) that alone slows the step, whoever is busy."""
    spinners = max(1, (os.cpu_count() or 2) - 1)
    idle: list[float] = []
    busy: list[float] = []
    for r in range(rounds):
        idle += offline.run(make_prompts(16, 128, offline.vocab, seed=700 + r), out_len)[1][1:]
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                 for _ in range(spinners)]
        try:
            time.sleep(0.2)
            busy += offline.run(make_prompts(16, 128, offline.vocab, seed=800 + r),
                                out_len)[1][1:]
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    return statistics.median(idle), statistics.median(busy), spinners


async def decode_kv_counters(nats_url: str) -> tuple[int, float]:
    """Summed (kv bytes received, kv transfer seconds) over live decode workers."""
    import nats

    from evenflow.proto import subjects
    from evenflow.proto.messages import WorkerHeartbeat, decode

    nc = await nats.connect(nats_url)
    sub = await nc.subscribe(subjects.HEARTBEATS)
    seen: dict[str, WorkerHeartbeat] = {}
    deadline = time.monotonic() + 3
    try:
        while time.monotonic() < deadline:
            try:
                msg = decode((await sub.next_msg(timeout=1)).data)
            except TimeoutError:
                continue
            if isinstance(msg, WorkerHeartbeat) and msg.role == "decode":
                seen[msg.worker_id] = msg
                if len(seen) >= 1 and time.monotonic() > deadline - 2:
                    break
    finally:
        await nc.close()
    return (sum(h.kv_bytes_received for h in seen.values()),
            sum(h.kv_transfer_seconds for h in seen.values()))


async def raw_nats_bandwidth(nats_url: str, transfer_bytes: int, chunk_bytes: int,
                             transfers: int) -> float:
    """Bytes/s of plain NATS publish -> subscriber for `transfers` transfers of that size; 0.0
    (printed as no figure) when a transfer has not fully arrived within 30 s — seen once on this
    2-vCPU host, so the rest of the bench still runs and reports."""
    import nats

    sender, receiver = await nats.connect(nats_url), await nats.connect(nats_url)
    payload = b"\x01" * chunk_bytes
    chunks = max(1, transfer_bytes // chunk_bytes)
    received = 0
    done = asyncio.Event()

    async def on_msg(msg) -> None:
        nonlocal received
        received += len(msg.data)
        if received >= chunks * chunk_bytes:
            done.set()

    await receiver.subscribe("evenflow.bench.raw", cb=on_msg)
    await receiver.flush()
    elapsed = 0.0
    for _ in range(transfers):
        received = 0
        done.clear()
        start = time.perf_counter()
        for _ in range(chunks):
            await sender.publish("evenflow.bench.raw", payload)
        await sender.flush()
        try:
            await asyncio.wait_for(done.wait(), 30)
        except TimeoutError:
            elapsed = 0.0
            break
        elapsed += time.perf_counter() - start
    await sender.close()
    await receiver.close()
    return chunks * chunk_bytes * transfers / elapsed if elapsed else 0.0


async def kv_figures(url: str, model: str, nats_url: str, vocab: int,
                     kv_prompt_len: int) -> dict:
    """Bytes and seconds of the prefill -> decode KV transfers of a few long prompts."""
    bytes0, secs0 = await decode_kv_counters(nats_url)
    kv_runs = 4
    await run_load(url, model, make_prompts(kv_runs, kv_prompt_len, vocab, seed=500), 2, 1)
    bytes1, secs1 = await decode_kv_counters(nats_url)
    return {"kv_bytes": bytes1 - bytes0, "kv_seconds": secs1 - secs0, "kv_runs": kv_runs}


def kv_per_token_line(model: str, itemsize: int, transfer_bytes: float, prompt_len: int
                      ) -> str:
    """The hand-off's KV bytes per prompt token (measured: one transfer over its prompt's
    tokens, the last block's unused slots included; and the cache layout's exact figure), next
    to a grouped-query model of the same width: the same layers and query heads with a quarter
    of them as KV heads (the benchmark Mixtral's 8 / 2), K and V as wide as this model's."""
    from evenflow.engine.config.families import load_model_config

    cfg = load_model_config(model)
    exact = cfg.kv_elements_per_token * itemsize
    k_dim, v_dim = (cfg.head_dim, cfg.v_head_dim) if cfg.mla else (cfg.head_dim, cfg.head_dim)
    kv_heads = max(1, cfg.num_heads // 4)
    gqa = cfg.num_layers * kv_heads * (k_dim + v_dim) * itemsize
    kind = (f"MLA latent {cfg.kv_lora_rank} + {cfg.qk_rope_head_dim} rope dims" if cfg.mla
            else f"{cfg.num_kv_heads} KV heads x {cfg.head_dim} dims, K and V")
    return (f"{'KV per token (bytes)':34} {transfer_bytes / prompt_len:10.0f} {exact:10d}"
            f"   (measured hand-off / layout; {kind}, {cfg.num_layers} layers); GQA of the same "
            f"width ({cfg.num_heads} heads / {kv_heads} KV heads): {gqa} bytes, "
            f"{gqa / exact:.2f}x this model's")


def int8_wire_line(model: str, itemsize: int, transfer_bytes: float, prompt_len: int,
                   block_size: int) -> str:
    """The int8 cache's hand-off bytes per token (measured) against the model dtype's layout."""
    import torch

    from evenflow.engine.config.families import load_model_config
    from evenflow.engine.model.kv_spec import KVCacheSpec

    cfg = load_model_config(model)
    int8 = KVCacheSpec.of(cfg, block_size, torch.bfloat16, "int8").bytes_per_block / block_size
    full = cfg.kv_elements_per_token * itemsize
    measured = transfer_bytes / prompt_len
    return (f"{'KV per token, int8 cache (bytes)':34} {measured:10.0f} {int8:10.0f}   "
            f"(measured hand-off / layout, scales included); the {itemsize}-byte layout: "
            f"{full} bytes, {full / measured:.2f}x the measured int8 hand-off")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evenflow bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the random 110M Mixtral")
    ap.add_argument("--arch", default="mixtral", choices=["mixtral", "deepseek_v3", "gpt_oss"],
                    help="without --model: the random 110M checkpoint in this family's shape")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens shared by all prompts")
    ap.add_argument("--overhead-prompt-len", type=int, default=512)
    ap.add_argument("--kv-prompt-len", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                    help="the mesh's KV cache (int8: the hand-off's bytes per token are printed "
                         "against the model dtype's layout)")
    ap.add_argument("--no-handoff-table", action="store_true",
                    help="skip the last table (the one-message K/V hand-off, two meshes)")
    ap.add_argument("--no-pull-table", action="store_true",
                    help="skip the KV pull vs recompute table (bench/mesh/pull_bench.py)")
    ap.add_argument("--base-url", default=None,
                    help="load an already running OpenAI-compatible server instead")
    ap.add_argument("--api-key", default=None, help="--base-url: its API key")
    ap.add_argument("--vocab-size", type=int, default=500,
                    help="--base-url: prompt token ids are drawn below this")
    ap.add_argument("--request-rate", type=float, default=float("inf"),
                    help="requests/s, Poisson arrivals (default: all at once)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the load run as JSON")
    ap.add_argument("--plot", default=None, metavar="DIR",
                    help="write TTFT/ITL CDFs and throughput over time as PNGs")
    args = ap.parse_args(argv)
    if args.base_url:
        return _against(args)
    with scratch_dir("serve") as root:  # (the random checkpoint: removed at the end)
        return _local(args, root)


def _local(args: argparse.Namespace, root: Path) -> int:
    """A local mesh against the engine alone on the same model (written under `root`)."""
    if args.quick:
        args.concurrency, args.num_requests, args.prompt_len, args.output_len = 4, 8, 32, 8
        args.overhead_prompt_len, args.kv_prompt_len, args.reps = 64, 128, 6
    tpot_rounds = (6, 8) if args.quick else (3, 2)  # batch 1, batch 16 (quick: ~1 ms steps)

    from evenflow.bench.checkpoint import QUICK_MODEL, write_family, write_random_mixtral
    from evenflow.services.config import MeshConfig
    from evenflow.services.launcher import LocalMesh

    size = "quick" if args.quick else "110m"
    if args.model:
        model = args.model
    elif args.arch == "mixtral":
        model = str(write_random_mixtral(root / f"mixtral-{size}",
                                         QUICK_MODEL if args.quick else None))
    else:
        model = str(write_family(root / f"{args.arch}-{size}", args.arch, args.quick))
    print(f"model: {model}")
    offline_engine = OfflineEngine(model)
    print(machine_line(offline_engine.engine.kv_dtype_name, 1))
    # No expert placement: the offline engine runs without it, and this measures the mesh.
    config = MeshConfig(model=model, port=0, local_prefill_threshold=0, num_threads=1,
                        kv_cache_gb=0.5, num_ep_ranks=0, kv_cache_dtype=args.kv_cache_dtype)
    mesh = LocalMesh(config)
    mesh.start(health_timeout_s=300)
    try:
        name = mesh.config.model_name
        offline, meshed, failed = run_client(interleaved_overhead(
            offline_engine, mesh.url, name, args.overhead_prompt_len, args.reps,
            args.output_len, tpot_rounds))
        neighbours = busy_neighbour_tpot(offline_engine, args.output_len)
        vocab = offline_engine.vocab
        offline_itemsize = offline_engine.engine.model_runner().kv_caches[0][0].element_size()
        del offline_engine  # (its memory, before the load run)
        admin_url = mesh.admin_nats_url or mesh.config.nats_url or ""
        figures = asyncio.run(kv_figures(mesh.url, name, admin_url, vocab, args.kv_prompt_len))
        per_transfer = figures["kv_bytes"] / max(1, figures["kv_runs"])
        raw = asyncio.run(raw_nats_bandwidth(admin_url, int(per_transfer),
                                             config.kv_chunk_bytes, figures["kv_runs"]))
        load = run_client(run_load(
            mesh.url, name, make_prompts(args.num_requests, args.prompt_len, vocab,
                                         args.shared_prefix, seed=600),
            args.output_len, args.concurrency))
    finally:
        mesh.stop()

    ms = 1e3
    kv_bw = figures["kv_bytes"] / figures["kv_seconds"] if figures["kv_seconds"] else 0.0
    print(f"\nmesh overhead ({args.overhead_prompt_len}-token prompts for TTFT, 128 in / "
          f"{args.output_len} out for TPOT; offline = the engine alone, 1 thread, in this "
          "process; offline and mesh runs alternate, medians; a batch-16 TPOT is its first "
          "gap - through the mesh the prefill -> decode handoff, offline the first decode "
          "step - and the mean of the gaps after it)")
    print(f"{'metric':34} {'offline':>10} {'mesh':>10} {'mesh - offline':>15} {'ratio':>7}")
    for label, key in (("TTFT p50 (ms)", "ttft"), ("TPOT p50, batch 1 (ms)", "tpot1"),
                       ("TPOT p50, batch 16 (ms)", "tpot16"),
                       ("  its first gap, p50 (ms)", "gap16"),
                       ("  the gaps after it, p50 (ms)", "rest16")):
        a, b = offline[key] * ms, meshed[key] * ms
        print(f"{label:34} {a:10.2f} {b:10.2f} {b - a:15.2f} {b / a:6.2f}x")
    print(f"{'KV transfer (MB/s)':34} {raw / 1e6:10.1f} {kv_bw / 1e6:10.1f} {'':15} "
          f"{kv_bw / raw if raw else 0:6.2f}x   (raw NATS publish vs prefill->decode, "
          f"{per_transfer / 1e6:.2f} MB per request)"
          + ("; no raw figure: a raw transfer timed out" if not raw else ""))
    print(kv_per_token_line(model, offline_itemsize, per_transfer, args.kv_prompt_len))
    if args.kv_cache_dtype == "int8":
        print(int8_wire_line(model, offline_itemsize, per_transfer, args.kv_prompt_len,
                             config.block_size))
    idle, busy, spinners = neighbours
    print(f"{'TPOT p50, batch 16, CPUs busy (ms)':34} {idle * ms:10.2f} {busy * ms:10.2f} "
          f"{(busy - idle) * ms:15.2f} {busy / idle:6.2f}x   (the engine alone, the other "
          f"{spinners} CPU(s) idle vs each running a spinning process: what any neighbour "
          "costs a step on this machine)")
    if failed:
        print(f"  ({failed} requests failed during the overhead runs)")
    _report(args, load, "gateway")
    if not args.no_handoff_table:
        from evenflow.bench.mesh.handoff_bench import handoff_table

        handoff_table(model, vocab, 6 if args.quick else 5, args.output_len)
    if not args.no_pull_table:
        from evenflow.bench.mesh.pull_bench import pull_table

        histories = [32, 64, 128] if args.quick else [32, 64, 128, 256, 1024, 2048]
        pull_table(model, vocab, histories, 2 if args.quick else 3)
    return 0


def _report(args: argparse.Namespace, load: LoadResult, name: str) -> None:
    rate = "all at once" if args.request_rate == float("inf") else f"{args.request_rate}/s"
    print(f"\nload: {args.num_requests} requests ({rate}), concurrency {args.concurrency}, "
          f"prompt {args.prompt_len} (shared prefix {args.shared_prefix}), output "
          f"{args.output_len}")
    print("\n".join(summary_rows(f"  {name}", load)))
    settings = {k: v for k, v in vars(args).items() if k not in ("api_key", "json", "plot")}
    if settings["request_rate"] == float("inf"):
        settings["request_rate"] = None
    if args.json:
        Path(args.json).write_text(json.dumps(result_json(load, settings), indent=1))
        print(f"  results written to {args.json}")
    if args.plot:
        print(f"  charts: {', '.join(write_plots(load, args.plot))}")


def _against(args: argparse.Namespace) -> int:
    """Only the load, against a server someone else runs."""
    import httpx

    url = args.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model
    if model is None:
        models = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"]
        model = models[0]["id"]
    print(f"server: {url}, model: {model}")
    load = run_client(run_load(
        url, model, make_prompts(args.num_requests, args.prompt_len, args.vocab_size,
                                 args.shared_prefix, seed=600),
        args.output_len, args.concurrency, args.api_key, args.request_rate, progress=True))
    _report(args, load, url)
    return 0 if load.timings else 1


if __name__ == "__main__":
    raise SystemExit(main())
