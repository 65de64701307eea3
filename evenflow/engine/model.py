"""The transformer: one model file for Llama, Qwen3, Mixtral, Qwen2-MoE and Qwen3-MoE.

Tokens of all sequences in a step are flattened into one batch (T tokens). Attention reads and
writes a paged KV cache through slot indices (slot = block_id * block_size + offset); MoE layers
route each token to its top-k experts, group tokens by expert and run one matmul per expert.
Module names follow the HF checkpoints, so loading is a rename only where experts are stacked.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from evenflow.engine.config import ModelConfig
from evenflow.engine.placement import SlotPlacement
from evenflow.engine.quant import QuantStack
from evenflow.parallel.group import ProcessGroup


@dataclass
class PrefillSegment:
    """One sequence's chunk of new tokens beyond the first token of a step's batch."""

    q_start: int  # offset of its first new token in the flat batch
    q_len: int  # new tokens this step
    ctx_len: int  # tokens visible to its last query: cached + earlier chunks + this chunk
    slots: Tensor | None  # (ctx_len,) cache slots of the whole context; None if ctx_len == q_len


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes, and what each query attends to.

    The flat batch holds the prefill segments' tokens first, then one token per decoding sequence.
    """

    slot_mapping: Tensor  # (T,) cache slot of each new token
    prefills: list[PrefillSegment]
    num_prefill_tokens: int
    decode_slots: Tensor | None  # (B_dec, L) context slots of each decoding sequence, padded
    decode_mask: Tensor | None  # (B_dec, 1, 1, L) True where a context slot is real


# (rows, expert) -> rows @ that expert's weight.T: dense or quantized (QuantStack.linear)
ExpertLinear = Callable[[Tensor, int], Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    """q, k and v come from one fused projection (qkv_proj: the loader concatenates the
    checkpoint's q_proj, k_proj and v_proj)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_out, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(
        self,
        x: Tensor,  # (T, H)
        cos: Tensor,  # (T, 1, hd)
        sin: Tensor,  # (T, 1, hd), first half negated
        k_cache: Tensor,  # (num_slots, n_kv, hd)
        v_cache: Tensor,
        meta: AttentionMetadata,
    ) -> Tensor:
        T, nh, n_kv, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(T, nh + 2 * n_kv, hd)
        qk, v = qkv[:, : nh + n_kv], qkv[:, nh + n_kv :]  # (T, nh + n_kv, hd), (T, n_kv, hd)
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, :nh]), self.k_norm(qk[:, nh:])], dim=1)
        # rotary on q and k heads at once: rotate_half(x) * sin == roll(x, hd/2) * signed sin
        # (bitwise; one op instead of four)
        qk = qk * cos + torch.roll(qk, hd // 2, -1) * sin
        q, k = qk[:, :nh], qk[:, nh:]  # (T, nh, hd), (T, n_kv, hd)
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)

        outs: list[Tensor] = []
        for seg in meta.prefills:
            # 4-D (1, heads, len, hd) inputs: torch's CPU flash kernel takes these (3-D falls
            # back to the slow math path).
            qs = q[seg.q_start : seg.q_start + seg.q_len].transpose(0, 1).unsqueeze(0)
            if seg.slots is None:  # whole context is this chunk: plain causal attention
                ks = k[seg.q_start : seg.q_start + seg.q_len].transpose(0, 1).unsqueeze(0)
                vs = v[seg.q_start : seg.q_start + seg.q_len].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:  # earlier context comes from the cache: causal mask offset by the cached part
                # (1, n_kv, ctx, hd)
                ks = k_cache.index_select(0, seg.slots).transpose(0, 1).unsqueeze(0)
                vs = v_cache.index_select(0, seg.slots).transpose(0, 1).unsqueeze(0)
                offset = seg.ctx_len - seg.q_len
                q_pos = torch.arange(seg.q_len).unsqueeze(1) + offset
                mask = torch.arange(seg.ctx_len).unsqueeze(0) <= q_pos  # (q, ctx)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
            outs.append(o[0].transpose(0, 1))  # (q, nh, hd)
        if meta.decode_slots is not None:
            B = meta.decode_slots.shape[0]
            group = self.num_heads // self.num_kv_heads
            # Queries sharing a KV head ride in the "query length" dimension: no KV expansion.
            qd = q[meta.num_prefill_tokens :].view(B, self.num_kv_heads, group, self.head_dim)
            flat = meta.decode_slots.flatten()
            L = meta.decode_slots.shape[1]
            # (B, n_kv, L, hd)
            kd = k_cache.index_select(0, flat).view(B, L, n_kv, hd).transpose(1, 2)
            vd = v_cache.index_select(0, flat).view(B, L, n_kv, hd).transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask)
            outs.append(o.reshape(B, self.num_heads, self.head_dim))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Top-k routed experts (plus an optional gated shared expert, as in Qwen2-MoE).

    Expert weights are stacked: w13 (E, 2I, H) holds gate and up, w2 (E, H, I) holds down.
    Each call adds its tokens-per-expert to `counts` (E,), which the engine exposes.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, H, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.num_experts, self.top_k = E, cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(H, E, bias=False)  # the router
        self.w13 = nn.Parameter(torch.empty(E, 2 * inter, H))
        self.w2 = nn.Parameter(torch.empty(E, H, inter))
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(H, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(H, 1, bias=False)
        self.counts: Tensor | None = None  # set by the engine: a row of its (layers, E) counter
        # Under an expert placement: physical slots, their weights, their token counts.
        self.placement: SlotPlacement | None = None
        self.slot_counts: Tensor | None = None  # a row of the engine's (layers, P) counter
        self._slot_w13: Tensor | None = None
        self._slot_w2: Tensor | None = None
        # Quantized experts (engine/quantize_model.py): w13 and w2 are then empty.
        self.quantized: tuple[QuantStack, QuantStack] | None = None
        self._slot_quantized: tuple[QuantStack, QuantStack] | None = None
        # Per-expert weights packed for oneDNN (engine/prepack.py): w13 and w2 are then empty.
        self.packed: tuple[list[Tensor], list[Tensor]] | None = None
        self._slot_packed: tuple[list[Tensor], list[Tensor]] | None = None

    def set_packed(self, w13: list[Tensor], w2: list[Tensor]) -> None:
        self.packed = (w13, w2)
        empty = torch.empty(0, *self.w13.shape[1:], dtype=self.w13.dtype)
        self.w13 = nn.Parameter(empty, requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(0, *self.w2.shape[1:], dtype=self.w2.dtype),
                               requires_grad=False)
        if self.placement is not None:
            self.set_placement(self.placement)

    def set_placement(self, placement: SlotPlacement) -> None:
        """Copy each slot's expert weights into place (between steps)."""
        if self.packed is not None:  # a list of references: no copies
            slots = placement.phy2log.tolist()
            self._slot_packed = ([self.packed[0][e] for e in slots],
                                 [self.packed[1][e] for e in slots])
        elif self.quantized is not None:
            q13, q2 = self.quantized
            self._slot_quantized = (q13.select(placement.phy2log), q2.select(placement.phy2log))
        else:
            self._slot_w13 = self.w13.index_select(0, placement.phy2log)
            self._slot_w2 = self.w2.index_select(0, placement.phy2log)
        self.placement = placement

    @property
    def num_slots(self) -> int:
        if self.placement is not None:
            return len(self.placement.phy2log)
        return self.num_experts

    def forward(self, x: Tensor) -> Tensor:  # (T, H)
        probs = F.softmax(self.gate(x).float(), dim=-1)  # (T, E)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # (T, k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat_experts = experts.flatten()  # (T*k,)
        if self.counts is not None:
            self.counts += torch.bincount(flat_experts, minlength=self.num_experts)
        groups = flat_experts
        counts: Tensor | None = None
        if self.placement is not None:  # each pair goes to one physical slot of its expert
            groups = self.placement.slots_for(flat_experts)
            if self.slot_counts is not None:
                counts = torch.bincount(groups, minlength=self.num_slots)
                self.slot_counts += counts
        gate_up, down = self._expert_linears()
        if x.shape[0] == 1:  # one token (batch-1 decode): its k experts, no grouping
            out = self._one_token(x, groups.tolist(), weights[0].tolist(), gate_up, down)
        else:
            if counts is None:
                counts = torch.bincount(groups, minlength=self.num_slots)
            out = self._grouped(x, groups, counts, weights, gate_up, down)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def _expert_linears(self) -> tuple[ExpertLinear, ExpertLinear]:
        """The experts' (gate_up, down) for the current slots: packed, quantized or plain."""
        placed = self.placement is not None
        if self.packed is not None:
            packed = self._slot_packed if placed else self.packed
            assert packed is not None
            return _packed_expert(packed[0]), _packed_expert(packed[1])
        if self.quantized is not None:
            stacks = self._slot_quantized if placed else self.quantized
            assert stacks is not None
            return stacks[0].linear, stacks[1].linear
        w13, w2 = (self._slot_w13, self._slot_w2) if placed else (self.w13, self.w2)
        assert w13 is not None and w2 is not None
        return _dense_expert(w13), _dense_expert(w2)

    @staticmethod
    def _one_token(x: Tensor, slots: list[int], weights: list[float], gate_up: ExpertLinear,
                   down: ExpertLinear) -> Tensor:
        """x (1, H) through its k experts (distinct slots), weighted and summed in float."""
        out: Tensor | None = None
        for j, slot in enumerate(slots):
            gate, up = gate_up(x, slot).chunk(2, dim=-1)
            y = down(F.silu(gate) * up, slot).float() * weights[j]
            out = y if out is None else out + y
        assert out is not None
        return out.to(x.dtype)

    def _grouped(self, x: Tensor, groups: Tensor, counts: Tensor, weights: Tensor,
                 gate_up: ExpertLinear, down: ExpertLinear) -> Tensor:
        """Tokens sorted by slot, each slot's rows through its expert in one matmul."""
        order = torch.argsort(groups, stable=True)
        token_of = order // self.top_k  # token index of each sorted (token, expert) pair
        xs = x[token_of]  # (T*k, H) grouped by expert
        counts_list = counts.tolist()
        active = sum(1 for n in counts_list if n)
        sorted_groups = groups[order]
        width = max(counts_list)
        plain = self.packed is None and self.quantized is None
        if plain and 2 * active >= len(counts_list) and width <= self.BATCHED_MAX_ROWS:
            placed = self.placement is not None
            w13, w2 = (self._slot_w13, self._slot_w2) if placed else (self.w13, self.w2)
            assert w13 is not None and w2 is not None
            ys = self._experts_batched(xs, sorted_groups, counts, width, w13, w2)
        else:
            ys = self._experts_looped(xs, sorted_groups, counts, counts_list, functools.partial(
                self._run_experts, gate_up=gate_up, down=down))
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
    def _run_experts(grouped: Tensor, counts: list[int], gate_up: ExpertLinear,
                     down: ExpertLinear) -> Tensor:
        """grouped (N, H): rows sorted by expert, counts[e] rows for expert e; only experts
        with rows are computed (and, quantized, read)."""
        ys = torch.empty_like(grouped)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            gate, up = gate_up(grouped[start : start + n], e).chunk(2, dim=-1)  # (n, 2I)
            ys[start : start + n] = down(F.silu(gate) * up, e)
            start += n
        return ys

    def _experts_batched(self, xs: Tensor, sorted_experts: Tensor, counts: Tensor,
                         width: int, w13: Tensor, w2: Tensor) -> Tensor:
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(len(xs)) - starts[sorted_experts]  # position within its expert
        padded = xs.new_zeros(w13.shape[0], width, xs.shape[1])  # (E, width, H)
        padded[sorted_experts, slot] = xs
        h = torch.bmm(padded, w13.transpose(1, 2))  # (E, width, 2I)
        gate, up = h.chunk(2, dim=-1)
        out = torch.bmm(F.silu(gate) * up, w2.transpose(1, 2))  # (E, width, H)
        return out[sorted_experts, slot]


def _dense_expert(weights: Tensor) -> ExpertLinear:
    """x @ weights[e].T for a stack of expert weights (E, out, in)."""
    return lambda x, e: F.linear(x, weights[e])


def _packed_expert(weights: list[Tensor]) -> ExpertLinear:
    """x @ expert e's weight.T, the weights packed for oneDNN (engine/prepack.py)."""
    return lambda x, e: torch.ops.mkldnn._linear_pointwise(x, weights[e], None, "none", [], "")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, sparse: bool) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp: nn.Module = MoE(cfg) if sparse else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Tensor parallel (engine/tp_shard.py): attention and MLP give partial sums
        self.tp: ProcessGroup | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: tuple[Tensor, Tensor],
                meta: AttentionMetadata) -> Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, kv[0], kv[1], meta)
        if self.tp is not None:
            self.tp.all_reduce(attn)
        x = x + attn
        mlp = self.mlp(self.post_attention_layernorm(x))
        if self.tp is not None:
            self.tp.all_reduce(mlp)
        return x + mlp


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, s) for s in cfg.sparse_layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """forward(tokens, positions, kv caches, metadata, rows to score) -> logits (float32)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._cos: Tensor | None = None
        self._sin: Tensor | None = None
        # Tensor parallel: this rank's vocabulary rows of embed_tokens and lm_head
        self.tp: ProcessGroup | None = None
        self.vocab_start, self.vocab_rows = 0, cfg.vocab_size

    def set_tensor_parallel(self, group: ProcessGroup) -> None:
        self.tp = group
        for layer in self.decoder_layers():
            layer.tp = group

    def decoder_layers(self) -> list[DecoderLayer]:
        return [layer for layer in self.model.layers if isinstance(layer, DecoderLayer)]

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank's cache holds."""
        return self.decoder_layers()[0].self_attn.num_kv_heads

    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    def init_rope(self, max_len: int, dtype: torch.dtype) -> None:
        hd = self.config.head_dim
        exponents = torch.arange(0, hd, 2, dtype=torch.float) / hd
        inv_freq = 1.0 / (self.config.rope_theta ** exponents)
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_len, hd)
        sin = emb.sin()
        sin[:, : hd // 2].neg_()  # signed for the roll in Attention.forward
        self._cos, self._sin = emb.cos().to(dtype), sin.to(dtype)

    def forward(
        self,
        input_ids: Tensor,  # (T,)
        positions: Tensor,  # (T,)
        kv_caches: list[tuple[Tensor, Tensor]],
        meta: AttentionMetadata,
        logit_rows: Tensor,  # (S,) rows of the flat batch whose next token is sampled
    ) -> Tensor:  # (S, vocab) float32
        assert self._cos is not None and self._sin is not None, "call init_rope first"
        cos = self._cos[positions].unsqueeze(1)  # (T, 1, hd)
        sin = self._sin[positions].unsqueeze(1)
        x = self._embed(input_ids)
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv, meta)
        x = self.model.norm(x[logit_rows])
        return self._logits(x)

    def _embed(self, input_ids: Tensor) -> Tensor:
        if self.tp is None:
            return self.model.embed_tokens(input_ids)
        local = input_ids - self.vocab_start  # rows outside this rank's slice contribute 0
        inside = (local >= 0) & (local < self.vocab_rows)
        x = self.model.embed_tokens(local.clamp(0, self.vocab_rows - 1))
        return self.tp.all_reduce(x * inside.unsqueeze(1).to(x.dtype))

    def _logits(self, x: Tensor) -> Tensor:
        logits = self.lm_head(x).float()
        if self.tp is None:
            return logits
        parts = self.tp.all_gather(logits)  # (N, S, rows)
        full = parts.transpose(0, 1).reshape(len(x), -1)
        return full[:, : self.config.vocab_size]
