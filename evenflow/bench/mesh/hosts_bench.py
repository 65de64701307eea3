"""`evenflow bench hosts`: what crossing hosts costs, measured between simulated hosts
(evenflow/dev/hosts.py: network namespaces, a private /dev/shm each, links shaped by tc).

- `kv`: the mesh's KV hand-off from a prefill worker on host B to a decode worker on host C
  (NATS and the gateway on A: each hand-off crosses B -> A -> C) against raw NATS publishes of
  the same bytes in the same chunks on the same path (publisher on B, subscriber on C), timed
  alike: from the sender's start to the last byte's arrival.
- `ep`: one MoE layer's expert-parallel step (dispatch all-to-all, the experts, combine) on
  2 hosts x 2 ranks (a DEP group formed through the rendezvous, hierarchical collectives: shm
  inside a host, gloo between) for the random DeepSeek-V3-shaped model's first MoE layer
  (64 experts, top-6), with each host's tokens skewed to experts of its own: the balancer's
  plain EPLB placement against its topology-aware one (balancer/topology.py) from the same
  load, the engine routing a host's rows to its own replicas. Medians per rank; the step is
  the slowest rank's (they meet in every all-to-all).

Links: --rate (tbf) and --delay-ms (netem, where the kernel has it; where it does not, the
run says so and goes on without delay).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RENDEZVOUS_PORT = 29611


# -- ep: one rank's part (run inside a simulated host) ----------------------------------------
def ep_rank_main(rank: int, world: int, address: str, model_dir: str, quick: bool) -> dict:
    import torch

    from evenflow.balancer.eplb import rebalance_from
    from evenflow.balancer.topology import host_routing, topology_aware
    from evenflow.engine.config.settings import EngineConfig
    from evenflow.engine.model.placement import SlotPlacement
    from evenflow.engine.weights.loader import load_weights, torch_dtype
    from evenflow.parallel.hierarchical import spanning_group
    from evenflow.parallel.rendezvous import join

    torch.set_num_threads(1)
    config = EngineConfig(model=model_dir, expert_parallel_size=world, prepack_weights=False)
    dtype = torch_dtype(config)
    model = load_weights(model_dir, dtype, config)
    layer = model.moe_layers()[0]
    E, k, H = layer.num_experts, layer.top_k, model.config.hidden_size
    P = E + 2 * world  # two redundant slots per rank
    membership = join(address, "bench-ep", rank, world, (world,), settle_s=60, timeout_s=300)
    group = spanning_group(membership, 64 << 20, 120.0)
    layer.ep = group
    hosts = group.hosts if hasattr(group, "hosts") else ["one"] * world
    names = sorted(set(hosts), key=hosts.index)
    rank_host = torch.tensor([names.index(h) for h in hosts])
    my_host = int(rank_host[rank])
    # each host's tokens: a skewed expert distribution of its own (hot experts differ)
    prefs = torch.ones(len(names), E)
    for h in range(len(names)):
        hot = torch.arange(h * 8, h * 8 + 8) % E
        prefs[h, hot] = 12.0
    prefs /= prefs.sum(1, keepdim=True)
    tokens_list = [32, 256] if quick else [32, 256, 1024]
    load = (prefs * (world // len(names)) * 1000 * k).unsqueeze(1)  # [hosts, 1 layer, E]
    initial = (torch.arange(P) % E).unsqueeze(0)
    plain = rebalance_from(initial, load.sum(0), world).phy2log
    topo = topology_aware(plain, load, world, rank_host)
    out: dict = {"dtype": str(dtype).removeprefix("torch."), "hidden": H, "experts": E,
                 "top_k": k, "hosts": len(names)}
    for name, phy2log in (("plain", plain), ("topology", topo)):
        _, cross = host_routing(load, phy2log, world, rank_host)
        out[f"{name}:modelled_cross_share"] = float(cross.sum() / load.sum())
        local = [r for r in range(world) if rank_host[r] == my_host]
        layer.set_placement(SlotPlacement.build(phy2log[0], E, world, None, local))
        per_rank = P // world
        for tokens in tokens_list:
            g = torch.Generator().manual_seed(1000 + rank)
            experts = torch.multinomial(prefs[my_host].expand(tokens, E), k, replacement=False,
                                        generator=g)
            weights = torch.full((tokens, k), 1.0 / k)
            x = torch.randn(tokens, H, generator=g).to(dtype)
            assert layer.placement is not None
            groups = layer.placement.slots_for(experts.flatten())
            crossing = int((rank_host[groups // per_rank] != my_host).sum())
            linears = layer.experts_in_use().linears()
            times = []
            reps = 5 if quick else 20
            for i in range(reps + 3):
                group.barrier()
                started = time.perf_counter()
                layer._expert_parallel(x, groups, weights, *linears)
                if i >= 3:
                    times.append(time.perf_counter() - started)
            mine = torch.tensor([statistics.median(times), float(crossing)], dtype=torch.float64)
            every = group.all_gather(mine)
            out[f"{name}:{tokens}"] = {"step_s": float(every[:, 0].max()),
                                       "rows_crossing": float(every[:, 1].sum())}
    group.close()
    return out


def run_ep(hosts: list, model_dir: str, quick: bool) -> dict:
    a = hosts[0]
    address = f"{a.address}:{RENDEZVOUS_PORT}"
    store = a.popen([sys.executable, "-m", "evenflow.parallel.rendezvous", address],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        world = 2 * len(hosts)
        procs = [hosts[r // 2].popen(
            [sys.executable, "-m", "evenflow.bench.mesh.hosts_bench", "--ep-rank", str(r),
             str(world), address, model_dir, json.dumps(quick)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
        outs = [p.communicate(timeout=1800) for p in procs]
        if procs[0].returncode:
            raise RuntimeError(f"rank 0 failed:\n{outs[0][1][-3000:]}")
        return json.loads(outs[0][0].strip().splitlines()[-1])
    finally:
        store.kill()
        store.wait()


# -- kv: the hand-off across hosts against raw NATS --------------------------------------------
RAW_SUBSCRIBER = """
import asyncio, json, struct, sys, time, nats
async def main(url, total, transfers):
    nc = await nats.connect(url)
    got, start, results, done = 0, 0.0, [], asyncio.Event()
    async def on_msg(msg):
        nonlocal got, start
        if got == 0:
            start = struct.unpack('d', msg.data[:8])[0]
        got += len(msg.data)
        if got >= total:
            results.append(time.time() - start)
            got = 0
            await nc.publish('evenflow.bench.raw.ack', b'1')
            if len(results) == transfers:
                done.set()
    await nc.subscribe('evenflow.bench.raw', cb=on_msg)
    await nc.flush()
    print('ready', flush=True)
    await asyncio.wait_for(done.wait(), 300)
    print(json.dumps(results), flush=True)
    await nc.close()
asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""

RAW_PUBLISHER = """
import asyncio, struct, sys, time, nats
async def main(url, chunk, chunks, transfers):
    nc = await nats.connect(url)
    acks = asyncio.Queue()
    async def on_ack(msg):
        acks.put_nowait(1)
    await nc.subscribe('evenflow.bench.raw.ack', cb=on_ack)
    await nc.flush()
    body = b'\\x01' * chunk
    for _ in range(transfers):
        await nc.publish('evenflow.bench.raw', struct.pack('d', time.time()) + body[8:])
        for _ in range(chunks - 1):
            await nc.publish('evenflow.bench.raw', body)
        await nc.flush()
        await asyncio.wait_for(acks.get(), 120)
    await nc.close()
asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
"""

KV_CLIENT = """
import asyncio, json, sys
from evenflow.bench.machine import bench_checkpoints
from evenflow.bench.mesh.serve_bench import kv_figures
print(json.dumps(asyncio.run(kv_figures(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]),
                                        int(sys.argv[5])))))
"""


def run_kv(cluster, model_dir: str, vocab: int, prompt_len: int, logdir: Path) -> dict:
    from evenflow.dev.hosts import HostProcesses
    from evenflow.services.launcher import find_binary

    a, b, c = cluster.hosts[:3]
    nats_url, url = f"nats://{a.address}:4222", f"http://{a.address}:8000"
    # the mesh as `bench serve` measures it: no expert placement, every prompt prefilled by
    # the prefill worker (so every request's KV crosses hosts)
    services = HostProcesses(logdir, {**os.environ, "EVENFLOW_LOCAL_PREFILL_THRESHOLD": "0",
                                      "EVENFLOW_NUM_EP_RANKS": "0"})
    start = services.start
    try:
        start(a, [find_binary("nats-server"), "-a", a.address, "-p", "4222"], "nats")
        start(a, [find_binary("redis-server"), "--bind", a.address, "--port", "6379",
                  "--save", "", "--appendonly", "no", "--dir", str(logdir)], "redis")
        common = ["--nats-url", nats_url, "--redis-url", f"redis://{a.address}:6379",
                  "--model", model_dir, "--kv-cache-gb", "0.5"]
        serve = [sys.executable, "-m", "evenflow.cli", "serve"]
        start(a, [*serve, "--roles", "gateway,kv_index", "--host", a.address, "--port",
                  "8000", *common], "host-a")
        start(b, [*serve, "--roles", "prefill", "--index", "1", *common], "host-b")
        start(c, [*serve, "--roles", "decode", "--index", "2", *common], "host-c")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            done = a.run([sys.executable, "-c", f"import httpx; print(httpx.get('{url}/health',"
                          " timeout=5).json()['status'])"], timeout=20)
            if done.stdout.strip().endswith("ok"):
                break
            time.sleep(2)
        else:
            raise RuntimeError(f"the mesh on 3 hosts did not become healthy; logs in {logdir}")
        model_name = Path(model_dir).name
        done = a.run([sys.executable, "-c", KV_CLIENT, url, model_name, nats_url, str(vocab),
                      str(prompt_len)], timeout=600)
        if done.returncode:
            raise RuntimeError(f"KV client failed: {done.stderr[-2000:]}")
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        per_transfer = int(figures["kv_bytes"] / max(1, figures["kv_runs"]))
        chunk = 512 * 1024
        chunks = max(1, per_transfer // chunk)
        sub = c.popen([sys.executable, "-c", RAW_SUBSCRIBER, nats_url, str(chunks * chunk),
                       str(figures["kv_runs"])], stdout=subprocess.PIPE, text=True)
        assert sub.stdout is not None
        sub.stdout.readline()  # ready
        b.run([sys.executable, "-c", RAW_PUBLISHER, nats_url, str(chunk), str(chunks),
               str(figures["kv_runs"])], timeout=600)
        raw_times = json.loads(sub.communicate(timeout=300)[0].strip().splitlines()[-1])
        figures["raw_bytes_per_s"] = chunks * chunk * len(raw_times) / sum(raw_times)
        figures["per_transfer"] = per_transfer
        return figures
    finally:
        services.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="evenflow bench hosts", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["all", "kv", "ep"], default="all")
    ap.add_argument("--rate", default="10gbit", help="each host's link rate (tc tbf)")
    ap.add_argument("--delay-ms", type=float, default=1.0,
                    help="each link's one-way delay (netem; skipped where the kernel lacks it)")
    ap.add_argument("--kv-prompt-len", type=int, default=2000)
    ap.add_argument("--quick", action="store_true", help="small model, few repetitions")
    args = ap.parse_args(argv)

    from evenflow.bench.checkpoint import (
        MIXTRAL_110M,
        QUICK_MODEL,
        write_family,
        write_random_mixtral,
    )
    from evenflow.bench.machine import bench_checkpoints, machine_line
    from evenflow.dev.hosts import HostsUnavailable, SimCluster

    root = bench_checkpoints()
    size = "quick" if args.quick else "110m"
    try:
        cluster = SimCluster.create(3 if args.part in ("all", "kv") else 2, rate=args.rate)
    except HostsUnavailable as exc:
        print(f"bench hosts: simulated hosts unavailable here: {exc}")
        return 1
    link = f"rate {args.rate}"
    try:
        if args.delay_ms:
            try:
                for host in cluster.hosts:
                    cluster.netem(host, args.delay_ms, args.rate)
                link += f", {args.delay_ms} ms each way"
            except HostsUnavailable as exc:
                link += f" (no delay: {exc})"
        print(f"{len(cluster.hosts)} simulated hosts on {os.cpu_count()} CPUs; links: {link}")
        if args.part in ("all", "ep"):
            model = str(write_family(root / f"deepseek_v3-{size}", "deepseek_v3", args.quick))
            ep = run_ep(cluster.hosts[:2], model, args.quick)
            print(machine_line(ep["dtype"], 1))
            print(f"\nEP: one MoE layer (dispatch + {ep['experts']} experts top-{ep['top_k']} + "
                  f"combine), hidden {ep['hidden']}, 2 hosts x 2 ranks, each host's tokens "
                  "skewed to 8 hot experts of its own; the step is the slowest rank's median")
            print(f"{'tokens/rank':>11} {'placement':>10} {'step (ms)':>10} "
                  f"{'rows crossing':>14} {'MB crossing':>12} {'vs plain':>9}")
            row_bytes = ep["hidden"] * (2 if ep["dtype"] == "bfloat16" else 4) * 2
            for key in sorted({k.split(":")[1] for k in ep if k.startswith("plain:")
                               and k.split(":")[1].isdigit()}, key=int):
                base = ep[f"plain:{key}"]["step_s"]
                for name in ("plain", "topology"):
                    fig = ep[f"{name}:{key}"]
                    print(f"{key:>11} {name:>10} {fig['step_s'] * 1e3:10.2f} "
                          f"{fig['rows_crossing']:14.0f} "
                          f"{fig['rows_crossing'] * row_bytes / 1e6:12.2f} "
                          f"{base / fig['step_s']:8.2f}x")
            print(f"(modelled share of rows crossing hosts: plain "
                  f"{ep['plain:modelled_cross_share']:.2f}, topology-aware "
                  f"{ep['topology:modelled_cross_share']:.2f}; MB counts dispatch and combine)")
        if args.part in ("all", "kv"):
            cfg = QUICK_MODEL if args.quick else MIXTRAL_110M
            model = str(write_random_mixtral(root / f"mixtral-{size}", QUICK_MODEL
                                             if args.quick else None))
            with tempfile.TemporaryDirectory(prefix="evenflow-hosts-kv-") as logdir:
                kv = run_kv(cluster, model, int(str(cfg["vocab_size"])), args.kv_prompt_len,
                            Path(logdir))
            mesh_bw = kv["kv_bytes"] / kv["kv_seconds"] if kv["kv_seconds"] else 0.0
            raw = kv["raw_bytes_per_s"]
            print(f"\nKV hand-off, prefill on B -> decode on C (NATS on A), "
                  f"{kv['per_transfer'] / 1e6:.2f} MB per request, {kv['kv_runs']} requests")
            print(f"{'':28} {'raw NATS':>10} {'hand-off':>10} {'ratio':>7}")
            print(f"{'bandwidth (MB/s)':28} {raw / 1e6:10.1f} {mesh_bw / 1e6:10.1f} "
                  f"{mesh_bw / raw if raw else 0:6.2f}x")
    finally:
        cluster.close()
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--ep-rank"]:
        r, w, addr, model_dir, q = sys.argv[2:7]
        print(json.dumps(ep_rank_main(int(r), int(w), addr, model_dir, json.loads(q))))
    else:
        raise SystemExit(main(sys.argv[1:]))
