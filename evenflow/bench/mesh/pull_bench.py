"""`evenflow bench serve`'s KV-pull table: a chat's next turn when the prefill worker lacks the
history that the decode worker holds, pulled (services/kv_pull.py) against recomputed.

Two local meshes at once, as `evenflow up --prefill 1 --decode 1` with the local-prefill
threshold at 0 (every prompt goes to the prefill worker): one pulls whatever it lacks
(kv_pull_min_tokens 1), the other never pulls (0). A conversation is a 32-token user message
answered with H tokens (greedy: the answer's blocks live on the decode worker only), then the
next turn: the whole history plus a new 32-token message, its TTFT measured. The meshes
alternate conversation by conversation. Printed: TTFT p50 per history length on each mesh, and
the crossover: straight lines fitted to both (TTFT = fixed + per token x H) over the histories
up to FIT_MAX tokens that were pulled (beyond, recompute's attention makes its time grow
faster than a line) meet at H* = (fixed pull - fixed recompute) / (per token recompute - per
token pull), the history below which recomputing is the faster (kv_pull_min_tokens' default
comes from it; services/config.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics

import httpx

from evenflow.bench.loadgen import RequestTiming, make_prompts, one_request
from evenflow.bench.mesh.handoff_bench import side_by_side
from evenflow.bench.sse_client import SSEClient

USER = 32  # tokens of each user message
FIT_MAX = 256  # the crossover's lines are fitted over histories up to this


async def _answer(http: httpx.AsyncClient, model: str, prompt: list[int], length: int
                  ) -> list[int]:
    """The mesh's greedy answer's token ids (logprobs naming ids)."""
    resp = await http.post("/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": length, "ignore_eos": True,
        "temperature": 0, "logprobs": 0, "return_tokens_as_token_ids": True})
    resp.raise_for_status()
    return [int(t.removeprefix("token_id:"))
            for t in resp.json()["choices"][0]["logprobs"]["tokens"]]


async def _ttfts(urls: dict[str, str], model: str, vocab: int, histories: list[int],
                 rounds: int) -> dict[str, dict[int, list[RequestTiming]]]:
    out: dict[str, dict[int, list[RequestTiming]]] = {n: {h: [] for h in histories}
                                                      for n in urls}
    async with contextlib.AsyncExitStack() as stack:
        https = {n: await stack.enter_async_context(httpx.AsyncClient(base_url=u, timeout=600))
                 for n, u in urls.items()}
        clients = {n: await stack.enter_async_context(SSEClient(u, timeout_s=600))
                   for n, u in urls.items()}
        for r in range(rounds):
            for h in histories:
                first, new = make_prompts(2, USER, vocab, seed=5000 + 10 * r + h)
                for name in urls:  # the same conversation on each mesh, one after the other
                    answer = await _answer(https[name], model, first, h)
                    await asyncio.sleep(0.3)  # the answer's KV events reach the index
                    timing = await one_request(clients[name], model, first + answer + new, 1,
                                               {})
                    out[name][h].append(timing)
    return out


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + b x: (a, b)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - b * mx, b


def pull_table(model: str, vocab: int, histories: list[int], rounds: int) -> float | None:
    """Print the table (starts and stops both meshes); the crossover in tokens (None: pulling
    never won or never lost in the fitted range)."""
    timings = side_by_side(model, {"pull": {"kv_pull_min_tokens": 1},
                                   "recompute": {"kv_pull_min_tokens": 0}},
                           lambda urls, name: _ttfts(urls, name, vocab, histories, rounds))
    print(f"\na chat's next turn, the history on the decode worker only ({USER}-token messages, "
          f"the answer H tokens; `up --prefill 1 --decode 1`, local-prefill threshold 0; the "
          f"two meshes alternate, {rounds} rounds): TTFT p50 (ms), the history pulled from "
          "the decode worker against recomputed")
    print(f"{'history H':>10} {'pull':>9} {'recompute':>10} {'recompute/pull':>15} "
          f"{'cached (pull)':>14} {'cached (recompute)':>19}")
    medians: dict[str, list[tuple[float, float]]] = {n: [] for n in timings}
    for h in histories:
        row = {n: statistics.median(t.ttft for t in timings[n][h]) * 1e3 for n in timings}
        cached = {n: statistics.median(t.cached_tokens for t in timings[n][h]) for n in timings}
        if h <= FIT_MAX and cached["pull"] > cached["recompute"]:
            for n in timings:
                medians[n].append((h, row[n]))
        print(f"{h:10d} {row['pull']:9.2f} {row['recompute']:10.2f} "
              f"{row['recompute'] / row['pull']:14.2f}x {cached['pull']:14.0f} "
              f"{cached['recompute']:19.0f}")
    if len(medians["pull"]) < 2:
        print(f"crossover: not measured (fewer than 2 pulled histories up to {FIT_MAX})")
        return None
    (a_pull, b_pull), (a_rec, b_rec) = _fit(medians["pull"]), _fit(medians["recompute"])
    print(f"fitted over the pulled histories up to {FIT_MAX} tokens: pull {a_pull:.2f} ms + "
          f"{b_pull * 1e3:.2f} us/token, recompute {a_rec:.2f} ms + {b_rec * 1e3:.2f} us/token")
    if b_rec <= b_pull:
        print("crossover: none (recomputing a token is no dearer than pulling it here)")
        return None
    crossover = max(0.0, (a_pull - a_rec) / (b_rec - b_pull))
    print(f"crossover: pulling wins above {crossover:.0f} tokens of history "
          "(kv_pull_min_tokens)")
    return crossover
