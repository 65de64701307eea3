"""`evenflow bench wire`: encode/decode time of the wire codec against the previous one
(bench/mesh/legacy_codec.py), on the same messages in one run: an 8k-token PrefillRequest, a
20k-hash KVSnapshot and a WorkerHeartbeat. Prints medians and ratios."""

from __future__ import annotations

import argparse
import functools
import platform
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from evenflow.bench.machine import machine_line
from evenflow.bench.mesh import legacy_codec
from evenflow.proto import messages as m
from evenflow.proto.sampling import SamplingParams


def sample_messages(seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    return {
        "PrefillRequest 8k tokens": m.PrefillRequest(
            request_id="req-0123456789abcdef", prompt_token_ids=[rng.randrange(32000)
                                                                for _ in range(8192)],
            sampling=SamplingParams(temperature=0.7, max_tokens=256, stop_token_ids=(2,)),
            reply_subject="evenflow.gateway.g1", decode_worker="d-1", enqueued_at=time.time()),
        "KVSnapshot 20k hashes": m.KVSnapshot(
            worker_id="p-1", role=m.Role.PREFILL, epoch="0123456789ab", seq=42,
            block_hashes=[rng.getrandbits(63) for _ in range(20000)]),
        "WorkerHeartbeat": m.WorkerHeartbeat(
            worker_id="d-1", role=m.Role.DECODE, model="tiny-moe", running=12, waiting=3,
            free_kv_blocks=900, total_kv_blocks=1024, sent_at=time.time(), epoch="abc",
            load_by_gateway={"evenflow.gateway.g1": 8, "evenflow.gateway.g2": 4}),
    }


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="evenflow bench wire", description=__doc__)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    print(machine_line(dtype="n/a (msgpack)"))
    print(f"python {platform.python_version()}, repeats {args.repeats}, medians in µs")
    header = f"{'message':<26}{'bytes':>9}{'old enc':>10}{'new enc':>10}{'enc x':>8}" \
             f"{'old dec':>10}{'new dec':>10}{'dec x':>8}"
    print(header)
    for name, message in sample_messages().items():
        new_payload, old_payload = m.encode(message), legacy_codec.encode(message)
        assert m.decode(new_payload) == message and legacy_codec.decode(old_payload) == message
        old_enc = _median_us(functools.partial(legacy_codec.encode, message), args.repeats)
        new_enc = _median_us(functools.partial(m.encode, message), args.repeats)
        old_dec = _median_us(functools.partial(legacy_codec.decode, old_payload), args.repeats)
        new_dec = _median_us(functools.partial(m.decode, new_payload), args.repeats)
        print(f"{name:<26}{len(new_payload):>9}{old_enc:>10.1f}{new_enc:>10.1f}"
              f"{old_enc / new_enc:>7.1f}x{old_dec:>10.1f}{new_dec:>10.1f}"
              f"{old_dec / new_dec:>7.1f}x")
    return 0
