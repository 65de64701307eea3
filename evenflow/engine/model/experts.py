"""A MoE layer's routed experts as one typed object per stored form, each owning its tensors and
how they compute (as vLLM's FusedMoEMethodBase does for its weight forms):

- `PlainExperts`: stacks w13 (E, 2I, H) holding gate and up, w2 (E, H, I) holding down;
- `PackedExperts`: one oneDNN-packed weight per expert (engine/weights/prepack.py);
- `FusedExperts`: one panel-packed weight per expert, for the fused kernel (engine/kernels/
  panels.py);
- `QuantizedExperts`: a QuantStack pair (engine/quant/): int8 / int4, panel-packed or not;
- `LocalExperts`: an expert-parallel rank's own slots only, each (gate_up, down) in one of the
  forms above (engine/weights/expert_store.py reads the ones a placement brings).

Every form answers the same questions: its slots under a placement (`select`, by reference
where the form allows), one expert's weights owning their memory (`expert`), its per-expert
linears (`linears`), the fused kernel's arguments where the form serves it (`fused_args`) and
its size. The MoE layer (model/moe.py) and the native decode stack (model/decode_stack.py) ask
these objects, never the layer's fields.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from evenflow.engine.kernels.panels import group_word
from evenflow.engine.quant.panel_stack import PanelStack
from evenflow.engine.quant.stacks import QuantStack

ExpertLinear = Callable[[Tensor, int], Tensor]  # (rows, expert) -> rows @ weight[expert].T
ExpertPair = tuple[Any, Any]  # one expert's (gate_up, down) in some stored form


def _packed_linear(x: Tensor, weight: Tensor) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


class ExpertWeights:
    """All experts (or a placement's slots) of one MoE layer in one stored form."""

    form: ClassVar[str]

    def select(self, index: Tensor) -> ExpertWeights:
        """The weights of slots `index` (P,): slot p holds expert index[p]."""
        raise NotImplementedError

    def expert(self, e: int) -> ExpertPair:
        """Expert e's (gate_up, down), owning its memory (kept when the rest is dropped)."""
        raise NotImplementedError

    def linears(self) -> tuple[ExpertLinear, ExpertLinear]:
        """(gate_up, down) as functions of (rows, expert)."""
        raise NotImplementedError(f"{self.form} experts run only in the fused kernel")

    def fused_args(self) -> tuple | None:
        """The fused kernel's weight arguments (engine/kernels/panels.run_experts), or None
        where this form is not the kernel's."""
        return None

    def nbytes(self) -> int:
        raise NotImplementedError


class PlainExperts(ExpertWeights):
    form = "plain"

    def __init__(self, w13: Tensor, w2: Tensor) -> None:
        self.w13, self.w2 = w13, w2  # (E, 2I, H), (E, H, I)

    def select(self, index: Tensor) -> PlainExperts:
        return PlainExperts(self.w13.index_select(0, index), self.w2.index_select(0, index))

    def expert(self, e: int) -> ExpertPair:
        return self.w13[e].clone(), self.w2[e].clone()

    def linears(self) -> tuple[ExpertLinear, ExpertLinear]:
        w13, w2 = self.w13, self.w2
        return (lambda x, e: F.linear(x, w13[e])), (lambda x, e: F.linear(x, w2[e]))

    def nbytes(self) -> int:
        return self.w13.nbytes + self.w2.nbytes


class _PerExpert(ExpertWeights):
    """One weight tensor per expert and part, selected by reference (no copies)."""

    def __init__(self, w13: list[Tensor], w2: list[Tensor]) -> None:
        self.w13, self.w2 = w13, w2

    def select(self, index: Tensor) -> ExpertWeights:
        slots = index.tolist()
        return type(self)([self.w13[e] for e in slots], [self.w2[e] for e in slots])

    def expert(self, e: int) -> ExpertPair:
        return self.w13[e], self.w2[e]

    def nbytes(self) -> int:
        # (element counts: oneDNN-packed tensors have no storage of their own)
        return sum(w.numel() * w.element_size() for w in self.w13 + self.w2)


class PackedExperts(_PerExpert):
    form = "packed"

    def linears(self) -> tuple[ExpertLinear, ExpertLinear]:
        w13, w2 = self.w13, self.w2
        return (lambda x, e: _packed_linear(x, w13[e])), (lambda x, e: _packed_linear(x, w2[e]))


class FusedExperts(_PerExpert):
    form = "fused"

    def fused_args(self) -> tuple:
        return self.w13, self.w2

    def linears(self) -> tuple[ExpertLinear, ExpertLinear]:
        """Per expert, through plain copies unpacked from the panels at the first call and
        kept (the fused kernel is the fast path; this one serves what it cannot: LoRA deltas
        on experts, at the cost of a second copy of the experts it ran)."""
        from evenflow.engine.kernels.panels import unpack_weight

        plain: dict[tuple[int, int], Tensor] = self.__dict__.setdefault("_plain", {})

        def weight(part: int, e: int) -> Tensor:
            w = plain.get((part, e))
            if w is None:
                packed = (self.w13 if part == 0 else self.w2)[e]
                w = plain[(part, e)] = unpack_weight(packed, gate_up=part == 0).contiguous()
            return w

        return (lambda x, e: F.linear(x, weight(0, e))), (lambda x, e: F.linear(x, weight(1, e)))


class QuantizedExperts(ExpertWeights):
    form = "quantized"

    def __init__(self, gate_up: QuantStack, down: QuantStack) -> None:
        self.gate_up, self.down = gate_up, down

    def select(self, index: Tensor) -> QuantizedExperts:
        return QuantizedExperts(self.gate_up.select(index), self.down.select(index))

    def expert(self, e: int) -> ExpertPair:
        index = torch.tensor([e])
        return self.gate_up.select(index), self.down.select(index)

    def linears(self) -> tuple[ExpertLinear, ExpertLinear]:
        return self.gate_up.linear, self.down.linear

    def fused_args(self) -> tuple | None:
        gate_up, down = self.gate_up, self.down
        if not (isinstance(gate_up, PanelStack) and isinstance(down, PanelStack)
                and down.in_features % 64 == 0 and down.out_features % 64 == 0):
            return None
        groups = {s.group_size for s in (gate_up, down) if s.group_size}
        if len(groups) > 1:  # (the kernel takes one group size)
            return None
        (w13, s13, o13), (w2, s2, o2) = gate_up.experts(), down.experts()
        return w13, w2, s13, s2, o13, o2, group_word(groups.pop() if groups else 0,
                                                      gate_up.dequant_from, down.dequant_from)

    def nbytes(self) -> int:
        return self.gate_up.nbytes() + self.down.nbytes()


class LocalExperts(ExpertWeights):
    """An expert-parallel rank's own slots, indexed from 0, each pair in the form `form`."""

    def __init__(self, pairs: list[ExpertPair], form: str) -> None:
        assert form in ("plain", "packed", "quantized"), f"no local {form} experts"
        self.pairs, self.form = pairs, form  # type: ignore[misc]

    def linears(self) -> tuple[ExpertLinear, ExpertLinear]:
        pairs = self.pairs
        if self.form == "quantized":
            return (lambda x, e: pairs[e][0].linear(x, 0)), (lambda x, e: pairs[e][1].linear(x, 0))
        if self.form == "packed":
            return (lambda x, e: _packed_linear(x, pairs[e][0])), \
                (lambda x, e: _packed_linear(x, pairs[e][1]))
        return (lambda x, e: F.linear(x, pairs[e][0])), (lambda x, e: F.linear(x, pairs[e][1]))

    def nbytes(self) -> int:
        def size(w: Any) -> int:
            return w.nbytes() if isinstance(w, QuantStack) else w.numel() * w.element_size()

        return sum(size(a) + size(b) for a, b in self.pairs)
