"""`evenflow doctor`'s view of expert-parallel ranks: the ExpertLoad reports every DEP rank sends
the balancer (its steps, its own experts' compute, the dispatch/combine collectives that include
waiting for the slowest rank, and the (token, expert) rows it computed), collected from NATS over
the workload's window, as each rank's per-step figures against its group's median."""

from __future__ import annotations

import statistics
from collections import defaultdict

from evenflow.proto import subjects
from evenflow.proto.messages import ExpertLoad, Message
from evenflow.services.bus import Bus


class RankLoadWatch:
    """Sums the ExpertLoad reports of every DEP rank while subscribed."""

    def __init__(self) -> None:
        self.bus = Bus("doctor")
        # (group, rank) -> [steps, step_s, compute_s, wait_s, rows]
        self.totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0] * 5)

    async def start(self, nats_url: str) -> None:
        await self.bus.connect(nats_url)
        await self.bus.subscribe(subjects.EXPERT_LOAD, self._on_load)

    async def stop(self) -> None:
        await self.bus.close()

    def _on_load(self, message: Message, _ctx: object) -> None:
        if isinstance(message, ExpertLoad) and message.group and message.steps > 0:
            total = self.totals[(message.group, message.worker_id)]
            for i, value in enumerate((message.steps, message.step_s, message.moe_compute_s,
                                       message.moe_wait_s, message.moe_rows)):
                total[i] += value

    def summary(self) -> list[dict]:
        """Per rank: ms per step in its experts and in the collectives, rows per step, and its
        compute over its group's median (the straggler stands out here)."""
        out = []
        groups = sorted({group for group, _ in self.totals})
        for group in groups:
            ranks = {rank: t for (g, rank), t in self.totals.items() if g == group and t[0]}
            compute = {rank: t[2] / t[0] for rank, t in ranks.items()}
            median = statistics.median(compute.values()) if compute else 0.0
            for rank, t in sorted(ranks.items()):
                steps = t[0]
                out.append({"group": group, "rank": rank, "steps": int(steps),
                            "step_ms": t[1] / steps * 1e3, "moe_compute_ms": t[2] / steps * 1e3,
                            "moe_wait_ms": t[3] / steps * 1e3, "rows_per_step": t[4] / steps,
                            "vs_group": compute[rank] / median if median > 0 else 1.0})
        return out
