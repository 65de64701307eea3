"""`evenflow doctor`'s view of expert-parallel ranks: the ExpertLoad reports every DEP rank sends
the balancer (its steps, its own experts' compute, the dispatch/combine collectives that include
waiting for the slowest rank, and the (token, expert) rows it computed), collected from NATS over
the workload's window, as each rank's per-step figures against its group's median; and every
engine worker's step time per token from its heartbeats (no tracing needed)."""

from __future__ import annotations

from collections import defaultdict

from evenflow.ops.stragglers import against_peers
from evenflow.proto import subjects
from evenflow.proto.messages import ExpertLoad, Message, WorkerHeartbeat
from evenflow.services.bus import MessageBus


class RankLoadWatch:
    """Sums the ExpertLoad reports of every DEP rank while subscribed."""

    def __init__(self) -> None:
        # (group, rank) -> [steps, step_s, compute_s, wait_s, rows]
        self.totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0] * 5)

    async def attach(self, bus: MessageBus) -> None:
        """Listen on a connected bus (the caller's: it closes it)."""
        await bus.subscribe(subjects.EXPERT_LOAD, self._on_load)

    def _on_load(self, message: Message, _ctx: object) -> None:
        if isinstance(message, ExpertLoad) and message.group and message.steps > 0:
            total = self.totals[(message.group, message.worker_id)]
            for i, value in enumerate((message.steps, message.step_s, message.moe_compute_s,
                                       message.moe_wait_s, message.moe_rows)):
                total[i] += value

    def summary(self) -> list[dict]:
        """Per rank: ms per step in its experts and in the collectives, rows per step, and its
        compute over the median of its group's other ranks (ops/stragglers.py)."""
        out = []
        groups = sorted({group for group, _ in self.totals})
        for group in groups:
            ranks = {rank: t for (g, rank), t in self.totals.items() if g == group and t[0]}
            compute = against_peers({rank: t[2] / t[0] for rank, t in ranks.items()})
            for rank, t in sorted(ranks.items()):
                steps = t[0]
                out.append({"group": group, "rank": rank, "steps": int(steps),
                            "step_ms": t[1] / steps * 1e3, "moe_compute_ms": t[2] / steps * 1e3,
                            "moe_wait_ms": t[3] / steps * 1e3, "rows_per_step": t[4] / steps,
                            "vs_group": compute[rank].vs_peers,
                            "straggler": compute[rank].straggler})
        return out


class WorkerStepWatch:
    """Every engine worker's cumulative step time and tokens, as its heartbeats carry them
    (WorkerHeartbeat v4): the first and the last seen while subscribed. What a running mesh
    already says about each instance, with no tracing set up."""

    def __init__(self) -> None:
        self.first: dict[str, WorkerHeartbeat] = {}
        self.last: dict[str, WorkerHeartbeat] = {}

    async def attach(self, bus: MessageBus) -> None:
        """Listen on a connected bus (the caller's: it closes it)."""
        await bus.subscribe(subjects.HEARTBEATS, self._on_heartbeat)

    def _on_heartbeat(self, message: Message, _ctx: object) -> None:
        if isinstance(message, WorkerHeartbeat) and message.role in ("prefill", "decode"):
            first = self.first.setdefault(message.worker_id, message)
            if message.epoch == first.epoch:  # (a restarted worker's counters start over)
                self.last[message.worker_id] = message

    def instances(self) -> list[dict]:
        """Per worker over the window: prefill ms per prompt token computed (its engine's step
        time over them), or decode ms per output token as its streams saw it (first token to
        last, over those tokens), against the median of its role's other workers."""
        cost: dict[tuple[str, str], float] = {}
        for worker, last in self.last.items():
            first = self.first[worker]
            if last.role == "prefill":
                seconds = last.step_seconds - first.step_seconds
                tokens = last.prompt_tokens_computed - first.prompt_tokens_computed
            else:
                seconds = last.stream_seconds - first.stream_seconds
                tokens = last.stream_tokens - first.stream_tokens
            if tokens > 0 and seconds > 0:
                cost[(str(last.role), worker)] = seconds / tokens
        out = []
        for role in ("prefill", "decode"):
            workers = {w: c for (r, w), c in cost.items() if r == role}
            if not workers:
                continue
            peers = against_peers(workers)
            for worker, value in sorted(workers.items()):
                out.append({"role": role, "worker": worker, "ms_per_token": value * 1e3,
                            "vs_peers": peers[worker].vs_peers,
                            "straggler": peers[worker].straggler, "samples": 0,
                            "source": "heartbeats"})
        return out
