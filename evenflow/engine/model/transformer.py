"""The transformer: one model file for Llama, Qwen3, Mixtral, Qwen2-MoE and Qwen3-MoE.

Tokens of all sequences in a step are flattened into one batch (T tokens). Attention reads and
writes a paged KV cache through slot indices (slot = block_id * block_size + offset); MoE layers
route each token to its top-k experts, group tokens by expert and run one matmul per expert.
Module names follow the HF checkpoints, so loading is a rename only where experts are stacked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from evenflow.engine.config import ModelConfig
from evenflow.engine.kernels import native
from evenflow.engine.model.ffn import MLP, MoE
from evenflow.parallel.group import ProcessGroup


@dataclass
class PrefillSegment:
    """One sequence's chunk of new tokens beyond the first token of a step's batch."""

    q_start: int  # offset of its first new token in the flat batch
    q_len: int  # new tokens this step
    ctx_len: int  # tokens visible to its last query: cached + earlier chunks + this chunk
    slots: Tensor | None  # (ctx_len,) cache slots of the whole context; None if ctx_len == q_len


# Decode attention runs the paged kernel (kernels/paged_attention.cpp: K and V read in place) at
# every batch size where its register-resident path serves the head shape (AVX-512 builds; head
# dim 64 or 128, a KV head's queries 4 / 2 / 1 at a time): 4-6x torch's gather +
# scaled_dot_product_attention at 1-32 sequences (`evenflow bench kernels`). On AVX-512 builds
# its general loop serves other shapes up to this many sequences, torch's path above (torch's
# bf16 flash kernel caught up with that loop from ~16 sequences). Built for AVX2 the loop ran
# 0.24-0.45x torch's path from 2 sequences on (and 0.43-2.4x at one, by the run) under the
# AVX2 emulation: there torch's path serves every batch.
PAGED_ATTENTION_MAX_BATCH = 8


def paged_decode_attention(batch: int, head_dim: int, group: int) -> bool:
    """Whether a decode step of `batch` sequences (heads of `head_dim`, `group` queries per KV
    head) runs the paged kernel (else torch's gathered attention, which alone needs the padding
    mask)."""
    if native.decode_attention() is None:
        return False
    if native.decode_attention_registers(head_dim, group):
        return True
    return batch <= PAGED_ATTENTION_MAX_BATCH and native.built_for_avx512()


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes, and what each query attends to.

    The flat batch holds the prefill segments' tokens first, then one token per decoding sequence.
    """

    slot_mapping: Tensor  # (T,) cache slot of each new token
    prefills: list[PrefillSegment]
    num_prefill_tokens: int
    decode_slots: Tensor | None  # (B_dec, L) context slots of each decoding sequence, padded
    # The runner picks the decode attention once per step (paged_decode_attention) and fills
    # the one input it reads: lens for the paged kernel, the additive mask for torch's path.
    decode_mask: Tensor | None  # (B_dec, 1, 1, L) 0 where a slot is real, -inf else (None: paged)
    decode_lens: Tensor | None = None  # (B_dec,) int64: how many of decode_slots are real


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        kernels = native.norms()
        if kernels is not None and x.dtype == self.weight.dtype and x.is_contiguous():
            return kernels.rms_norm(x, self.weight, self.eps)  # one pass (kernels/norm.cpp)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_and_norm(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """(x + residual, its norm), in one pass when the native kernel is there."""
        kernels = native.norms()
        if kernels is not None and x.dtype == residual.dtype == self.weight.dtype and \
                x.is_contiguous() and residual.is_contiguous():
            return kernels.add_rms_norm(x, residual, self.weight, self.eps)
        x = x + residual
        return x, F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def gathered_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
                              mask: Tensor | None) -> Tensor:
    """torch's decode attention: q (B, nh, hd) over each sequence's context slots (B, L),
    gathered into a padded copy, with an additive mask over the padding -> (B, nh, hd)."""
    (B, L), (nh, hd), n_kv = slots.shape, q.shape[1:], k_cache.shape[1]
    # Queries sharing a KV head ride in the "query length" dimension: no KV expansion.
    qd = q.reshape(B, n_kv, nh // n_kv, hd)
    flat = slots.flatten()
    kd = k_cache.index_select(0, flat).view(B, L, n_kv, hd).transpose(1, 2)  # (B, n_kv, L, hd)
    vd = v_cache.index_select(0, flat).view(B, L, n_kv, hd).transpose(1, 2)
    return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask).reshape(B, nh, hd)


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
        fused = native.rotary_kv_write() if not meta.prefills and not self.qk_norm else None
        if fused is not None and qkv.is_contiguous() and qkv.dtype == cos.dtype == k_cache.dtype:
            # a decode-only step: rotary, the K/V write and q's layout in one pass
            q = fused(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, nh, n_kv)
            return self.o_proj(self._decode_attention(q, k_cache, v_cache, meta).reshape(
                T, nh * hd))
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
        kernel = native.prefill_attention() if meta.prefills and q.dtype == k_cache.dtype and \
            k_cache.is_contiguous() and v_cache.is_contiguous() and \
            native.prefill_attention_serves(q.dtype, hd, nh // n_kv) else None
        for seg in meta.prefills:
            if kernel is not None:  # over the cache, where K and V were just written
                slots = seg.slots if seg.slots is not None else \
                    meta.slot_mapping[seg.q_start : seg.q_start + seg.q_len]
                outs.append(kernel(q[seg.q_start : seg.q_start + seg.q_len], k_cache, v_cache,
                                   slots, hd**-0.5))
                continue
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
            outs.append(self._decode_attention(q[meta.num_prefill_tokens :], k_cache, v_cache,
                                               meta))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))

    def _decode_attention(self, q: Tensor, k_cache: Tensor, v_cache: Tensor,
                          meta: AttentionMetadata) -> Tensor:
        """q (B, nh, hd): each decoding sequence's one query over its context -> (B, nh, hd)."""
        assert meta.decode_slots is not None
        if meta.decode_lens is not None:  # K and V read where they lie (paged_attention.cpp)
            paged = native.decode_attention()
            assert paged is not None
            return paged(q.contiguous(), k_cache, v_cache, meta.decode_slots, meta.decode_lens,
                         self.head_dim**-0.5)
        return gathered_decode_attention(q, k_cache, v_cache, meta.decode_slots,
                                         meta.decode_mask)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, sparse: bool) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp: nn.Module = MoE(cfg) if sparse else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Tensor parallel (engine/weights/tp_shard.py): attention and MLP give partial sums
        self.tp: ProcessGroup | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: tuple[Tensor, Tensor],
                meta: AttentionMetadata, pending: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
        """x: the residual stream; pending: the layer before's MLP output, not yet added to it
        (the add is fused into this layer's first norm, as the attention output's is into the
        second). -> (the residual stream, this layer's MLP output: the next layer's pending)."""
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_and_norm(pending, x)
        attn = self.self_attn(h, cos, sin, kv[0], kv[1], meta)
        if self.tp is not None:
            self.tp.all_reduce(attn)
        x, h = self.post_attention_layernorm.add_and_norm(x, attn)
        mlp = self.mlp(h)
        if self.tp is not None:
            self.tp.all_reduce(mlp)
        return x, mlp


class DecodeStack(Protocol):
    """A decode-only step's decoder layers (and maybe the whole step) as one native call,
    bit-identical to the module path (model/decode_stack.py's FastDecodeStack)."""

    def usable(self) -> bool:
        """Still built from the model's current weights and placement."""
        ...

    def head_usable(self) -> bool:
        """`step` may make the logits (embedding to lm_head) too."""
        ...

    def serves(self, meta: AttentionMetadata, dtypes: tuple[torch.dtype, ...],
               kv: tuple[Tensor, Tensor]) -> bool:
        ...

    def step(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, Tensor]],
             meta: AttentionMetadata) -> Tensor:  # (T, vocab) float32
        ...

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor,
                 kv_caches: list[tuple[Tensor, Tensor]], meta: AttentionMetadata
                 ) -> tuple[Tensor, Tensor]:
        ...


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
        # Decode-only steps' layers as one native call, made at the first decode by
        # decode_stack_builder (model/decode_stack.py's fast_stack, set by the runner unless
        # switched off); None where the layers do not qualify
        self.decode_stack_builder: Callable[[CausalLM], DecodeStack | None] | None = None
        self._fast: DecodeStack | None = None
        self._fast_checked = False
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
        fast = self._fast_decode(meta, kv_caches)
        if fast is not None and len(logit_rows) == len(input_ids) and fast.head_usable():
            return fast.step(input_ids, positions, kv_caches, meta)  # the whole step in C++
        cos = self._cos.index_select(0, positions).unsqueeze(1)  # (T, 1, hd)
        sin = self._sin.index_select(0, positions).unsqueeze(1)
        x = self._embed(input_ids)
        pending: Tensor | None = None
        if fast is not None:
            x, pending = fast(x, cos, sin, kv_caches, meta)
        else:
            for layer, kv in zip(self.model.layers, kv_caches, strict=True):
                x, pending = layer(x, cos, sin, kv, meta, pending)
        if len(logit_rows) != len(x):  # (rows are ascending and distinct: else every row)
            x = x[logit_rows]
            pending = None if pending is None else pending[logit_rows]
        if pending is None:  # (no layers)
            return self._logits(self.model.norm(x))
        _, h = self.model.norm.add_and_norm(pending, x)
        return self._logits(h)

    def _fast_decode(self, meta: AttentionMetadata, kv_caches: list[tuple[Tensor, Tensor]]
                     ) -> DecodeStack | None:
        """The fast decode stack where it takes this step (no builder: never)."""
        build = self.decode_stack_builder
        if meta.prefills or not kv_caches or build is None:
            return None
        if not self._fast_checked:
            self._fast_checked = True
            self._fast = build(self)
        fast = self._fast
        if fast is not None and not fast.usable():  # e.g. a new expert placement: rebuilt
            fast = self._fast = build(self)
        if fast is None or self._cos is None:
            return None
        dtypes = (self.model.embed_tokens.weight.dtype, self._cos.dtype)
        return fast if fast.serves(meta, dtypes, kv_caches[0]) else None

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
