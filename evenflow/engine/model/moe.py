"""The routed-expert MoE half of a decoder layer.

MoE layers route each token to its top-k experts (through physical slots under an expert
placement). Where the fused kernel serves (engine/kernels/panels.py: bf16 with AVX512-BF16, or
fp32) all routed experts run in one native call; otherwise tokens are grouped by expert and each
expert runs its own matmuls, over plain stacks, weights packed per expert for oneDNN
(engine/weights/prepack.py) or quantized ones (engine/quant/stacks.py). Under expert
parallelism the pairs travel to the ranks holding their slots (engine/model/moe_dispatch.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from evenflow.engine.config.settings import ModelConfig
from evenflow.engine.kernels import panels
from evenflow.engine.model.experts import (
    ExpertLinear,
    ExpertPair,
    ExpertWeights,
    LocalExperts,
    PlainExperts,
)
from evenflow.engine.model.mlp import MLP
from evenflow.engine.model.moe_dispatch import EPTimer, dispatch_and_combine
from evenflow.engine.model.placement import SlotPlacement
from evenflow.engine.model.routing import Routing, route
from evenflow.parallel.group import ProcessGroup


def clamped_swiglu(gate_up: Tensor, alpha: float, limit: float) -> Tensor:
    """GPT-OSS's expert activation over [gate | up]: (up + 1) * gate * sigmoid(alpha * gate),
    gate clamped above at limit, up to [-limit, limit]."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class MoE(nn.Module):
    """Top-k routed experts, plus optional shared experts: gated (Qwen2-MoE) or added as they
    are (DeepSeek). Experts may carry biases and GPT-OSS's clamped SwiGLU (then they run on
    the per-expert paths, never the fused kernel).

    Checkpoints load into stacked parameters, w13 (E, 2I, H) holding gate and up and w2
    (E, H, I) holding down; a stored form (model/experts.py: packed, fused, quantized) may take
    their place (`store`). Each call adds its tokens-per-expert to `counts` (E,), which the
    engine exposes.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, H, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.top_k = E, cfg.num_experts_per_tok
        self.routing = Routing.of(cfg)
        self.route_kernel: Any = None  # kernels/routing.cpp, as the runner chose (None: torch)
        self.gate = nn.Linear(H, E, bias=cfg.router_bias)  # the router
        # DeepSeek-V3's e_score_correction_bias: added to the scores for the choice only
        self.score_bias = nn.Parameter(torch.empty(E)) if cfg.score_correction_bias else None
        self.w13 = nn.Parameter(torch.empty(E, 2 * inter, H))
        self.w2 = nn.Parameter(torch.empty(E, H, inter))
        # per logical expert (kept whole on every rank: they are small)
        self.b13 = nn.Parameter(torch.empty(E, 2 * inter)) if cfg.expert_bias else None
        self.b2 = nn.Parameter(torch.empty(E, H)) if cfg.expert_bias else None
        self.activation = cfg.expert_activation
        self.swiglu = (cfg.swiglu_alpha, cfg.swiglu_limit)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(H, cfg.shared_expert_intermediate_size)
            if cfg.shared_expert_gated:
                self.shared_expert_gate = nn.Linear(H, 1, bias=False)
        self.counts: Tensor | None = None  # set by the engine: a row of its (layers, E) counter
        # Every expert in a stored form other than the plain stacks (then w13 and w2 are empty)
        self.stored: ExpertWeights | None = None
        # Under an expert placement: physical slots, their weights, their token counts.
        self.placement: SlotPlacement | None = None
        self.slot_counts: Tensor | None = None  # a row of the engine's (layers, P) counter
        self._slots: ExpertWeights | None = None
        # Expert parallel (engine/dep/offline.py): this rank computes only its share of the
        # placement's slots (rank-major); tokens travel to them and back by all-to-all.
        self.ep: ProcessGroup | None = None
        self.ep_timer: EPTimer | None = None  # shared by a rank's MoE layers
        # Set on expert-parallel ranks that keep only their own slots' experts: fetch(e) reads
        # logical expert e (engine/weights/expert_store.py) when a placement brings it to this rank.
        self.fetch_expert: Callable[[int], tuple[Any, Any]] | None = None
        self.resident: dict[int, ExpertPair] | None = None  # logical expert -> weights
        # the fused kernel's per-slot biases, with the placement they were cut for (kept by
        # reference: a new placement object means new slots)
        self._slot_biases: tuple[SlotPlacement | None, Tensor | None, Tensor | None] | None = \
            None
        # LoRA (model/lora.py): the model's adapters, set once one is loaded; this layer's index
        self.adapters: Any = None
        self.layer_index = 0

    @property
    def fused_epilogue(self) -> dict[str, Any] | None:
        """The fused kernel's epilogue arguments for these experts (their biases per slot, in
        float32, and the activation), or None where the kernel does not compute their
        activation."""
        if self.activation not in panels.ACTIVATIONS:
            return None
        if self.b13 is None and self.b2 is None:
            return {"activation": self.activation, "alpha": self.swiglu[0],
                    "limit": self.swiglu[1]} if self.activation != "silu" else {}
        if self._slot_biases is None or self._slot_biases[0] is not self.placement:
            index = self.placement.phy2log if self.placement is not None else None

            def per_slot(b: Tensor | None) -> Tensor | None:
                if b is None:
                    return None
                return (b if index is None else b.index_select(0, index)).float().contiguous()

            self._slot_biases = (self.placement, per_slot(self.b13), per_slot(self.b2))
        _, b13, b2 = self._slot_biases
        return {"b13": b13, "b2": b2, "activation": self.activation,
                "alpha": float(self.swiglu[0] or 1.0), "limit": float(self.swiglu[1] or 0.0)}

    @property
    def plain_experts(self) -> bool:
        """silu(gate) * up without biases: what the fused kernel and the padded bmm compute."""
        return self.b13 is None and self.activation == "silu"

    def all_experts(self) -> ExpertWeights:
        """Every logical expert, in the stored form (the plain stacks unless stored)."""
        return self.stored if self.stored is not None else PlainExperts(self.w13, self.w2)

    def experts_in_use(self) -> ExpertWeights:
        """What a step computes with: the placement's slots, or every expert."""
        if self.placement is None:
            return self.all_experts()
        assert self._slots is not None
        return self._slots

    def store(self, experts: ExpertWeights) -> None:
        """Keep every expert in this form from now on; the plain stacks are dropped."""
        self.stored = experts
        self._drop_stacks()
        if self.placement is not None:
            self.set_placement(self.placement)

    def _drop_stacks(self) -> None:
        self.w13 = nn.Parameter(torch.empty(0, *self.w13.shape[1:], dtype=self.w13.dtype),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(0, *self.w2.shape[1:], dtype=self.w2.dtype),
                               requires_grad=False)

    def set_placement(self, placement: SlotPlacement) -> int:
        """Put each slot's expert weights in place (between steps); how many experts had to be
        read (only ranks that keep just their own experts read any)."""
        if self.ep is not None and self.fetch_expert is not None:
            return self._place_own_slots(placement)
        self._slots = self.all_experts().select(placement.phy2log)
        self.placement = placement
        return 0

    @property
    def form(self) -> str:
        """How expert weights are stored: "fused", "packed", "quantized" or "plain"."""
        if self.resident is not None:
            assert self._slots is not None
            return self._slots.form
        return self.all_experts().form

    def _place_own_slots(self, placement: SlotPlacement) -> int:
        """Keep exactly the experts this rank's slots hold under `placement`: the ones it
        has stay, the missing ones are read, the rest are dropped."""
        assert self.ep is not None and self.fetch_expert is not None
        per_rank = placement.num_slots // self.ep.world_size
        first = self.ep.rank * per_rank
        needed = placement.phy2log[first : first + per_rank].tolist()
        form, resident = self.form, self.resident
        if resident is None:  # the first placement: keep ours of every expert
            every = self.all_experts()
            kept = {e: every.expert(e) for e in set(needed)}
        else:
            kept = {e: resident[e] for e in set(needed) if e in resident}
        missing = sorted(set(needed) - set(kept))
        for e in missing:
            kept[e] = self.fetch_expert(e)
        self.resident = kept
        self._slots = LocalExperts([kept[e] for e in needed], form)
        self.stored = None  # the full stacks (every expert) are gone for good
        self._drop_stacks()
        self.placement = placement
        return len(missing)

    def resident_bytes(self) -> int:
        """Bytes of expert weights this layer holds."""
        if self.resident is not None:
            return LocalExperts(list(self.resident.values()), self.form).nbytes()
        return self.all_experts().nbytes()

    @property
    def num_slots(self) -> int:
        if self.placement is not None:
            return len(self.placement.phy2log)
        return self.num_experts

    def forward(self, x: Tensor) -> Tensor:  # (T, H)
        weights, experts = route(self.gate, x, self.routing, self.counts,
                                 self.score_bias, self.route_kernel)  # (T, k) each
        adapters = self.adapters
        if adapters is not None and adapters.step is not None and self.ep is None and any(
                (self.layer_index, w) in a.experts for a, _ in adapters.step.groups
                for w in ("w13", "w2")):
            return self._add_shared_expert(x, self._experts_with_adapters(x, weights, experts))
        groups = flat_experts = experts.flatten()  # (T*k,)
        counts: Tensor | None = None
        if self.placement is not None:  # each pair goes to one physical slot of its expert
            groups = self.placement.slots_for(flat_experts)
            if self.slot_counts is not None:
                counts = torch.bincount(groups, minlength=self.num_slots)
                self.slot_counts += counts
        in_use = self.experts_in_use()
        epilogue = self.fused_epilogue if self.ep is None else None
        fused = in_use.fused_args() if epilogue is not None else None
        if fused is not None:  # every routed expert in one native call
            assert epilogue is not None
            out = panels.run_experts(x, groups.view(experts.shape), weights, *fused, **epilogue)
            return self._add_shared_expert(x, out)
        if self.ep is not None:
            out = self._expert_parallel(x, groups, weights, *in_use.linears())
        elif x.shape[0] == 1:  # one token (batch-1 decode): its k experts, no grouping
            out = self._one_token(x, groups.tolist(), weights[0].tolist(),
                                  self._expert_mlp(*in_use.linears()))
        else:
            if counts is None:
                counts = torch.bincount(groups, minlength=self.num_slots)
            out = self._grouped(x, groups, counts, weights, in_use)
        return self._add_shared_expert(x, out)

    def _experts_with_adapters(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """The routed experts with each row's LoRA deltas (model/lora.py) on its expert's
        gate_up and down projections: expert by expert, through the stored form's own
        per-expert linears."""
        from evenflow.engine.model.lora import apply

        adapters = self.adapters
        step, row_adapter = adapters.step, adapters.row_adapter
        flat = experts.flatten()
        groups = flat if self.placement is None else self.placement.slots_for(flat)
        if self.slot_counts is not None and self.placement is not None:
            self.slot_counts += torch.bincount(groups, minlength=self.num_slots)
        gate_up, down = self.experts_in_use().linears()
        flat_weights = weights.flatten()
        out = torch.zeros(x.shape, dtype=torch.float32)

        def add(h: Tensor, y: Tensor, tokens: Tensor, which: str, logical: int) -> Tensor:
            for i, (adapter, _) in enumerate(step.groups):
                deltas = adapter.experts.get((self.layer_index, which), {}).get(logical, ())
                if not deltas:
                    continue
                mine = (row_adapter[tokens] == i).nonzero().flatten()
                for delta in deltas:
                    y[mine, delta.cols] += apply(h[mine], delta).to(y.dtype)
            return y

        for slot in torch.unique(groups).tolist():
            pairs = (groups == slot).nonzero().flatten()
            tokens = pairs // self.top_k
            logical = int(flat[pairs[0]])
            h = x[tokens]
            g = add(h, gate_up(h, slot), tokens, "w13", logical)
            if self.b13 is not None:
                g = g + self.b13[logical]
            a = self._activate(g)
            y = add(a, down(a, slot), tokens, "w2", logical)
            if self.b2 is not None:
                y = y + self.b2[logical]
            out.index_add_(0, tokens, y.float() * flat_weights[pairs].unsqueeze(1))
        return out.to(x.dtype)

    def _add_shared_expert(self, x: Tensor, out: Tensor) -> Tensor:
        if self.shared_expert is None:
            return out
        if self.shared_expert_gate is None:
            return out + self.shared_expert(x)
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

    def _expert_mlp(self, gate_up: ExpertLinear, down: ExpertLinear, offset: int = 0
                    ) -> ExpertLinear:
        """(rows, index) -> rows through that expert's MLP; `index` + offset is its physical
        slot (or the logical expert without a placement), which picks the biases."""
        if self.plain_experts:
            def plain(h: Tensor, e: int) -> Tensor:
                gate, up = gate_up(h, e).chunk(2, dim=-1)
                return down(F.silu(gate) * up, e)
            return plain
        phy2log = None if self.placement is None else self.placement.phy2log.tolist()

        def general(h: Tensor, e: int) -> Tensor:
            logical = e + offset if phy2log is None else phy2log[e + offset]
            g = gate_up(h, e)
            if self.b13 is not None:
                g = g + self.b13[logical]
            y = down(self._activate(g), e)
            return y + self.b2[logical] if self.b2 is not None else y
        return general

    def _activate(self, gate_up: Tensor) -> Tensor:
        """[gate | up] (..., 2I) -> (..., I)."""
        if self.activation == "clamped_swiglu":
            return clamped_swiglu(gate_up, *self.swiglu)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def _one_token(x: Tensor, slots: list[int], weights: list[float], mlp: ExpertLinear
                   ) -> Tensor:
        """x (1, H) through its k experts (distinct slots), weighted and summed in float."""
        out: Tensor | None = None
        for j, slot in enumerate(slots):
            y = mlp(x, slot).float() * weights[j]
            out = y if out is None else out + y
        assert out is not None
        return out.to(x.dtype)

    def _expert_parallel(self, x: Tensor, groups: Tensor, weights: Tensor,
                         gate_up: ExpertLinear, down: ExpertLinear) -> Tensor:
        """The pairs through the ranks holding their slots (engine/model/moe_dispatch.py);
        this rank's own slots run grouped by slot."""
        ep = self.ep
        assert ep is not None
        first = ep.rank * (self.num_slots // ep.world_size)
        base = 0 if self.resident is not None else first  # own-slot weights start at 0
        mlp = self._expert_mlp(lambda h, e: gate_up(h, base + e),
                               lambda h, e: down(h, base + e), offset=first)

        def own_experts(rows: Tensor, local: Tensor, per_rank: int) -> Tensor:
            ys = torch.empty_like(rows)
            by_slot = torch.argsort(local, stable=True)
            counts = torch.bincount(local, minlength=per_rank)
            ys[by_slot] = self._experts_looped(
                rows[by_slot], local[by_slot], counts, counts.tolist(),
                functools.partial(self._run_experts, mlp=mlp))
            return ys

        return dispatch_and_combine(ep, x, groups, weights, self.top_k, self.num_slots,
                                    own_experts, self.ep_timer)

    def _grouped(self, x: Tensor, groups: Tensor, counts: Tensor, weights: Tensor,
                 in_use: ExpertWeights) -> Tensor:
        """Tokens sorted by slot, each slot's rows through its expert in one matmul."""
        order = torch.argsort(groups, stable=True)
        token_of = order // self.top_k  # token index of each sorted (token, expert) pair
        xs = x[token_of]  # (T*k, H) grouped by expert
        counts_list = counts.tolist()
        active = sum(1 for n in counts_list if n)
        sorted_groups = groups[order]
        width = max(counts_list)
        if isinstance(in_use, PlainExperts) and 2 * active >= len(counts_list) \
                and width <= self.BATCHED_MAX_ROWS:
            ys = self._experts_batched(xs, sorted_groups, counts, width, in_use.w13, in_use.w2)
        else:
            mlp = self._expert_mlp(*in_use.linears())
            ys = self._experts_looped(xs, sorted_groups, counts, counts_list, functools.partial(
                self._run_experts, mlp=mlp))
        ys = (ys.float() * weights.flatten()[order].unsqueeze(1)).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, ys)

    # When most experts are busy with at most this many tokens each (decode batches), all
    # experts run in one padded bmm: the step is bound by reading expert weights, and one call
    # streams them faster than a loop of small matmuls. Larger or sparser groups loop.
    BATCHED_MAX_ROWS = 16

    # With more than ALIGN_ABOVE pairs (prefill), each expert's row count is rounded up to a
    # multiple of ROW_ALIGN: oneDNN builds a kernel per matmul shape, and a few recurring shapes
    # beat a new one per step. Small decode groups take few shapes anyway and skip the padding.
    ROW_ALIGN = 16
    ALIGN_ABOVE = 128

    def _experts_looped(self, xs: Tensor, sorted_experts: Tensor, counts: Tensor,
                        counts_list: list[int], run: Callable[[Tensor, list[int]], Tensor]
                        ) -> Tensor:
        """run(grouped rows, rows per expert): the experts' matmuls, dense or quantized."""
        if len(xs) <= self.ALIGN_ABOVE:
            return run(xs, counts_list)
        align = self.ROW_ALIGN
        padded = [-(-n // align) * align for n in counts_list]
        starts = torch.cumsum(counts, 0) - counts
        padded_starts = torch.tensor([0, *padded[:-1]]).cumsum(0)
        rows = padded_starts[sorted_experts] + torch.arange(len(xs)) - starts[sorted_experts]
        grouped = xs.new_zeros(sum(padded), xs.shape[1]).index_copy_(0, rows, xs)
        return run(grouped, padded).index_select(0, rows)

    @staticmethod
    def _run_experts(grouped: Tensor, counts: list[int], mlp: ExpertLinear) -> Tensor:
        """grouped (N, H): rows sorted by expert, counts[e] rows for expert e; only experts
        with rows are computed (and, quantized, read)."""
        ys = torch.empty_like(grouped)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            ys[start : start + n] = mlp(grouped[start : start + n], e)
            start += n
        return ys

    def _experts_batched(self, xs: Tensor, sorted_experts: Tensor, counts: Tensor,
                         width: int, w13: Tensor, w2: Tensor) -> Tensor:
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(len(xs)) - starts[sorted_experts]  # position within its expert
        padded = xs.new_zeros(w13.shape[0], width, xs.shape[1])  # (E, width, H)
        padded[sorted_experts, slot] = xs
        h = torch.bmm(padded, w13.transpose(1, 2))  # (E, width, 2I)
        if self.b13 is not None and self.b2 is not None:  # biases of each slot's expert
            index = self.placement.phy2log if self.placement is not None else \
                torch.arange(self.num_experts)
            h = h + self.b13.index_select(0, index).unsqueeze(1)
            out = torch.bmm(self._activate(h), w2.transpose(1, 2))  # (E, width, H)
            out = out + self.b2.index_select(0, index).unsqueeze(1)
        else:
            out = torch.bmm(self._activate(h), w2.transpose(1, 2))
        return out[sorted_experts, slot]

