"""Which workers to use: live workers from heartbeats, and one pure cost function.

Until the KV index exists every prompt is uncached, so the cost is load: a prefill worker's
queued prompt tokens plus what this gateway has in flight there; a decode worker's running and
waiting sequences plus in-flight, among those with free KV blocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from evenflow.proto.messages import WorkerHeartbeat


@dataclass
class WorkerState:
    heartbeat: WorkerHeartbeat
    seen_at: float  # local monotonic clock
    inflight: int = 0  # this gateway's requests routed there and not finished


def cost(w: float, blocks_to_prefill: int, load: float) -> float:
    """Dynamo's form: cost = w * blocks_to_prefill + load (lower is better)."""
    return w * blocks_to_prefill + load


class WorkerRegistry:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.workers: dict[str, WorkerState] = {}

    def observe(self, hb: WorkerHeartbeat) -> None:
        state = self.workers.get(hb.worker_id)
        if state is None:
            self.workers[hb.worker_id] = WorkerState(hb, time.monotonic())
        else:
            state.heartbeat, state.seen_at = hb, time.monotonic()

    def is_live(self, worker_id: str) -> bool:
        state = self.workers.get(worker_id)
        return state is not None and time.monotonic() - state.seen_at < self.timeout_s

    def live(self, role: str) -> list[WorkerState]:
        return [s for s in self.workers.values()
                if s.heartbeat.role == role and self.is_live(s.heartbeat.worker_id)]

    def pick_prefill(self, prompt_tokens: int, block_size: int) -> WorkerState | None:
        blocks = -(-prompt_tokens // block_size)
        candidates = self.live("prefill")
        return min(candidates, key=lambda s: cost(
            1.0, blocks, s.heartbeat.queued_prompt_tokens / block_size + s.inflight * blocks),
            default=None)

    def pick_decode(self, needed_blocks: int, exclude: set[str]) -> WorkerState | None:
        candidates = [s for s in self.live("decode")
                      if s.heartbeat.worker_id not in exclude
                      and s.heartbeat.free_kv_blocks >= needed_blocks]
        return min(candidates, key=lambda s: cost(
            0.0, 0, s.heartbeat.running + s.heartbeat.waiting + s.inflight), default=None)
