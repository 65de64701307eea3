"""An OpenAI-API load generator: streamed completions at a fixed concurrency (and, optionally,
Poisson arrivals at a request rate), timing every token as it arrives. Prompts are token-id
lists (exact lengths), optionally sharing a prefix. Works against any OpenAI-compatible server
(vLLM, Dynamo, evenflow); results go out as text, JSON and PNG charts."""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from evenflow.bench.sse_client import SSEClient

# What a failed request raises here: an HTTP status, an error event, a lost connection.
REQUEST_ERRORS = (RuntimeError, OSError, EOFError, ValueError)
T = TypeVar("T")


@dataclass
class RequestTiming:
    started: float  # seconds since the run began
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
    first_error: str = ""
    wall: float = 0.0

    @property
    def throughput(self) -> float:
        return sum(t.output_tokens for t in self.timings) / self.wall if self.wall else 0.0


def run_client(main: Coroutine[Any, Any, T]) -> T:
    """Run a load generator's coroutine on uvloop when it is installed (its per-event cost is
    a fraction of asyncio's: the load generator shares this machine's CPUs with what it
    measures), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


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


async def whole_request(client: SSEClient, model: str, prompt: list[int], max_tokens: int,
                        headers: dict[str, str]) -> RequestTiming:
    """A non-streamed completion: its whole time stands for its time to first token."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    start = time.perf_counter()
    async with client.stream("/v1/completions", body, headers) as events:
        answer = orjson.loads(await events.whole())  # type: ignore[attr-defined]
    end = time.perf_counter()
    if "error" in answer:
        raise RuntimeError(answer["error"]["message"])
    usage = answer.get("usage") or {}
    return RequestTiming(start, end - start, [], end - start,
                         usage.get("completion_tokens", max_tokens),
                         usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                         usage.get("prompt_tokens", len(prompt)),
                         answer["choices"][0].get("text", ""))


async def one_request(client: SSEClient, model: str, prompt: list[int], max_tokens: int,
                      headers: dict[str, str], extra: dict | None = None) -> RequestTiming:
    """One streamed completion; `extra`: more body fields (e.g. priority)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            **(extra or {})}
    start = time.perf_counter()
    arrivals: list[float] = []
    pieces: list[str] = []
    usage: dict = {}
    async with client.stream("/v1/completions", body, headers) as events:
        async for data in events:
            if data == b"[DONE]":
                continue
            chunk = orjson.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            choice = chunk["choices"][0] if chunk.get("choices") else None
            # a token's chunk: text, or none where a token decodes to nothing (a server that
            # streams every token, as Dynamo's mocker does with token ids of no text)
            if choice is not None and (choice.get("text") or
                                       choice.get("finish_reason") is None):
                arrivals.append(time.perf_counter())
                pieces.append(choice.get("text") or "")
    end = time.perf_counter()
    if not arrivals:
        raise RuntimeError("no tokens arrived")
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return RequestTiming(start, arrivals[0] - start, gaps,
                         end - start, usage.get("completion_tokens", len(arrivals)),
                         usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                         usage.get("prompt_tokens", len(prompt)), "".join(pieces))


async def run_load(url: str, model: str, prompts: list[list[int]], max_tokens: int,
                   concurrency: int, api_key: str | None = None,
                   request_rate: float = float("inf"), seed: int = 0,
                   progress: bool = False, stream: bool = True) -> LoadResult:
    """Send every prompt, at most `concurrency` at a time; with a finite request_rate,
    requests arrive as a Poisson process of that rate (exponential gaps, seeded). stream=False:
    non-streamed completions (each one's time counts as its TTFT)."""
    request = one_request if stream else whole_request
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result = LoadResult()
    rng = random.Random(seed)
    slots = asyncio.Semaphore(concurrency)
    done = 0

    async def one(client: SSEClient, prompt: list[int], t0: float) -> None:
        nonlocal done
        async with slots:
            try:
                timing = await request(client, model, prompt, max_tokens, headers)
                timing.started -= t0
                result.timings.append(timing)
            except REQUEST_ERRORS as exc:
                result.errors += 1
                result.first_error = result.first_error or str(exc)
        done += 1
        if progress:
            _progress(done, len(prompts))

    async with SSEClient(url, timeout_s=300, max_idle=concurrency + 4) as client:
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(client, prompt, start)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
        result.wall = time.perf_counter() - start
    if progress:
        print(file=sys.stderr)
    return result


def _progress(done: int, total: int, width: int = 30) -> None:
    filled = width * done // max(1, total)
    print(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests",
          end="", file=sys.stderr, flush=True)


def summary_rows(name: str, result: LoadResult) -> list[str]:
    ms = 1e3
    ttft = [t.ttft * ms for t in result.timings]
    tpot = [t.tpot * ms for t in result.timings]
    itl = [x * ms for t in result.timings for x in t.itls]
    rows = [f"{name}: {len(result.timings)} ok, {result.errors} failed, "
            f"{result.throughput:.1f} output tok/s"
            + (f" (first failure: {result.first_error})" if result.first_error else "")]
    for label, values in (("TTFT", ttft), ("TPOT", tpot), ("ITL", itl)):
        rows.append(f"  {label:5} ms  p50 {percentile(values, 50):8.1f}  p90 "
                    f"{percentile(values, 90):8.1f}  p99 {percentile(values, 99):8.1f}"
                    + (f"  mean {statistics.fmean(values):8.1f}" if values else ""))
    return rows


def result_json(result: LoadResult, settings: dict) -> dict:
    """The run as JSON: settings, summary percentiles, and every request's timings."""
    ms = 1e3

    def stats(values: list[float]) -> dict:
        if not values:
            return {"p50": None, "p90": None, "p99": None, "mean": None}
        return {"p50": percentile(values, 50), "p90": percentile(values, 90),
                "p99": percentile(values, 99), "mean": statistics.fmean(values)}

    return {"settings": settings, "completed": len(result.timings), "failed": result.errors,
            "duration_s": result.wall, "output_tokens_per_s": result.throughput,
            "requests_per_s": len(result.timings) / result.wall if result.wall else 0.0,
            "ttft_ms": stats([t.ttft * ms for t in result.timings]),
            "tpot_ms": stats([t.tpot * ms for t in result.timings]),
            "itl_ms": stats([x * ms for t in result.timings for x in t.itls]),
            "requests": [{"started_s": t.started, "ttft_s": t.ttft, "e2e_s": t.e2e,
                          "output_tokens": t.output_tokens, "prompt_tokens": t.prompt_tokens,
                          "cached_tokens": t.cached_tokens} for t in result.timings]}


def write_plots(result: LoadResult, directory: str) -> list[str]:
    """TTFT and ITL CDFs and output throughput over time as PNGs (matplotlib when installed,
    else evenflow's own line charts); the paths written."""
    from pathlib import Path

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    ttft = sorted(t.ttft * 1e3 for t in result.timings)
    itl = sorted(x * 1e3 for t in result.timings for x in t.itls)
    cdf = {name: [(v, (i + 1) / len(vs)) for i, v in enumerate(vs)]
           for name, vs in (("ttft", ttft), ("itl", itl))}
    # output tokens finished per second, by 1 s bins of completion time
    bins: dict[int, int] = {}
    for t in result.timings:
        second = int(t.started + t.e2e)
        bins[second] = bins.get(second, 0) + t.output_tokens
    over_time = [(float(s), float(bins.get(s, 0))) for s in range(max(bins, default=0) + 1)]
    charts = {"ttft_cdf.png": ("TTFT (ms)", "fraction of requests", cdf["ttft"]),
              "itl_cdf.png": ("inter-token latency (ms)", "fraction of gaps", cdf["itl"]),
              "throughput.png": ("time (s)", "output tokens/s", over_time)}
    written = []
    plt: Any = None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot

        plt = matplotlib.pyplot
    except ImportError:
        pass
    for name, (xlabel, ylabel, points) in charts.items():
        path = str(out / name)
        if plt is not None:
            fig, ax = plt.subplots(figsize=(7, 4))
            ax.plot([p[0] for p in points], [p[1] for p in points])
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            fig.tight_layout()
            fig.savefig(path, dpi=100)
            plt.close(fig)
        else:
            from evenflow.bench.png import line_chart

            line_chart(path, [points])
        written.append(path)
    return written
