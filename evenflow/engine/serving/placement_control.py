"""The engine's side of expert placement (a part Engine holds, `engine.placement`): apply a
placement at once (virtual ranks), or stage one and take it one MoE layer per call between
steps (real expert-parallel ranks, engine/dep/lockstep.py and engine/dep/offline.py), and hand
out the per-slot token counts the balancer balances on."""

from __future__ import annotations

import time
from typing import Protocol

import torch

from evenflow.engine.config.settings import EngineConfig
from evenflow.engine.runners.model_runner import ModelRunner
from evenflow.engine.weights.expert_store import PlacementMoves, StagedPlacement
from evenflow.proto.engine_values import EPTopology, ExpertLoadCounts, RankTiming


class PlacementOwner(Protocol):
    """What the part reads of its engine (each call: a kernel switch replaces the runner)."""

    config: EngineConfig

    def model_runner(self) -> ModelRunner: ...


class ExpertPlacement:
    def __init__(self, owner: PlacementOwner, moe_layers: int = 0, slots: int = 0) -> None:
        self._owner = owner
        # (moe_layers, slots) tokens routed since the last take; empty: no placement
        self.slot_counts = torch.zeros(moe_layers, slots, dtype=torch.int64)
        self.version = 0
        self.moves = PlacementMoves()  # the layers' switches, timed
        self._staged: StagedPlacement | None = None  # a placement being taken layer by layer

    @property
    def config(self) -> EngineConfig:
        return self._owner.config

    @property
    def runner(self) -> ModelRunner:
        return self._owner.model_runner()

    @property
    def staged_version(self) -> int:
        """The version of the placement being taken layer by layer (-1: none)."""
        return self._staged.version if self._staged is not None else -1

    def apply_placement(self, phy2log: torch.Tensor, share: torch.Tensor | None,
                        version: int) -> None:
        """Put every MoE layer under a new expert placement (call between steps): phy2log
        (moe_layers, slots), share (moe_layers, slots) or None for even replica shares."""
        assert self.config.num_ep_ranks, "the engine runs without expert parallelism"
        assert phy2log.shape == self.slot_counts.shape, "placement shape does not fit"
        assert isinstance(self.runner, ModelRunner)
        self.runner.apply_placement(phy2log, share, self.config.num_ep_ranks)
        self.version = version

    def begin_placement(self, phy2log: torch.Tensor, share: torch.Tensor | None,
                        version: int) -> None:
        """Start taking a placement one MoE layer per advance_placement() call (between
        steps): expert-parallel ranks call both at the same points, so each layer switches on
        every rank before the same step, and no step waits for more than one layer's reads."""
        assert phy2log.shape == self.slot_counts.shape, "placement shape does not fit"
        self._staged = StagedPlacement(phy2log, share, version)

    def advance_placement(self) -> None:
        """Switch the next layer of a placement begun with begin_placement."""
        staged = self._staged
        if staged is None:
            return
        assert isinstance(self.runner, ModelRunner)
        row, started = staged.next_row, time.perf_counter()
        read = self.runner.apply_layer_placement(
            row, staged.phy2log[row], None if staged.share is None else staged.share[row],
            self.config.num_ep_ranks)
        self.moves.add(time.perf_counter() - started, read)
        staged.next_row += 1
        if staged.next_row == staged.phy2log.shape[0]:
            self.version, self._staged = staged.version, None

    @property
    def active(self) -> bool:
        return self.slot_counts.numel() > 0

    def apply_expert_placement(self, version: int, phy2log: list[int],
                               shares: list[float]) -> None:
        """apply_placement from row-major lists, as they come off the wire."""
        shape = tuple(self.slot_counts.shape)
        self.apply_placement(torch.tensor(phy2log).view(shape),
                             torch.tensor(shares, dtype=torch.float32).view(shape), version)

    def take_expert_load(self) -> ExpertLoadCounts:
        """Token counts per (MoE layer, slot) since the last call."""
        counts = self.take_slot_counts()
        return ExpertLoadCounts(counts.shape[0], counts.shape[1], counts.flatten().tolist())

    def take_rank_timing(self) -> RankTiming | None:
        return None  # not an expert-parallel rank (engine/dep/lockstep.py is)

    def ep_topology(self) -> EPTopology | None:
        return None  # not an expert-parallel rank

    def take_slot_counts(self) -> torch.Tensor:
        """Tokens per (MoE layer, physical slot) since the last call."""
        counts = self.slot_counts.clone()
        self.slot_counts.zero_()
        return counts

