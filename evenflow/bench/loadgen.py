"""An OpenAI-API load generator: streamed completions at a fixed concurrency, timing every
token as it arrives. Prompts are token-id lists (exact lengths), optionally sharing a prefix."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
import orjson


@dataclass
class RequestTiming:
    ttft: float  # seconds to the first token
    itls: list[float]  # gaps between later chunks
    e2e: float
    output_tokens: int
    cached_tokens: int
    prompt_tokens: int = 0
    text: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / max(1, self.output_tokens - 1)


@dataclass
class LoadResult:
    timings: list[RequestTiming] = field(default_factory=list)
    errors: int = 0
    wall: float = 0.0

    @property
    def throughput(self) -> float:
        return sum(t.output_tokens for t in self.timings) / self.wall if self.wall else 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def make_prompts(n: int, length: int, vocab: int, shared_prefix: int = 0,
                 seed: int = 0) -> list[list[int]]:
    """n prompts of `length` token ids (ids from 3 up, clear of specials); the first
    `shared_prefix` tokens are common to all."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(length - shared_prefix)]
            for _ in range(n)]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      max_tokens: int, headers: dict[str, str]) -> RequestTiming:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    arrivals: list[float] = []
    pieces: list[str] = []
    usage: dict = {}
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
                pieces.append(chunk["choices"][0]["text"])
    end = time.perf_counter()
    if not arrivals:
        raise RuntimeError("no tokens arrived")
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return RequestTiming(arrivals[0] - start, gaps,
                         end - start, usage.get("completion_tokens", len(arrivals)),
                         usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                         usage.get("prompt_tokens", len(prompt)), "".join(pieces))


async def run_load(url: str, model: str, prompts: list[list[int]], max_tokens: int,
                   concurrency: int, api_key: str | None = None) -> LoadResult:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result = LoadResult()
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            try:
                result.timings.append(await one_request(client, url, model, prompt,
                                                        max_tokens, headers))
            except (RuntimeError, httpx.HTTPError):
                result.errors += 1

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        result.wall = time.perf_counter() - start
    return result


def summary_rows(name: str, result: LoadResult) -> list[str]:
    ms = 1e3
    ttft = [t.ttft * ms for t in result.timings]
    tpot = [t.tpot * ms for t in result.timings]
    itl = [x * ms for t in result.timings for x in t.itls]
    rows = [f"{name}: {len(result.timings)} ok, {result.errors} failed, "
            f"{result.throughput:.1f} output tok/s"]
    for label, values in (("TTFT", ttft), ("TPOT", tpot), ("ITL", itl)):
        rows.append(f"  {label:5} ms  p50 {percentile(values, 50):8.1f}  p90 "
                    f"{percentile(values, 90):8.1f}  p99 {percentile(values, 99):8.1f}"
                    + (f"  mean {statistics.fmean(values):8.1f}" if values else ""))
    return rows
