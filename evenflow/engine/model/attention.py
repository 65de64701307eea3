"""Grouped-query attention over the paged KV cache: q, k and v from one fused projection,
rotary embeddings, the K/V written into their cache slots, then the prefill segments' causal
attention (the native flash-style kernel or torch's) and the decoding sequences' attention (the
paged kernel, reading K and V in place, or torch's gathered one).

A layer with a sliding window or attention sinks (GPT-OSS) decodes on the paged kernel too (each
sequence's last `window` slots, `window_view`; the sinks join the kernel's softmax) and computes
its prefill attention explicitly in torch (`windowed_attention`): keys older than the window are
masked out, and each head's learned sink logit joins every softmax's denominator. (The window
limits what a query reads; the blocks past it stay allocated until the sequence ends, as the
full-attention layers need them.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from evenflow.engine.config.settings import ModelConfig
from evenflow.engine.kernels import native
from evenflow.engine.model.kv_quant import (
    gather_dequantized,
    paged_decode_attention_int8,
    write_quantized,
)
from evenflow.engine.model.metadata import AttentionMetadata
from evenflow.engine.model.norm import RMSNorm
from evenflow.parallel.group import ProcessGroup

# Decode attention runs the paged kernel (kernels/paged_attention.cpp: K and V read in place) at
# every batch size where its register-resident path serves the head shape (AVX-512 builds; head
# dim 64 or 128, a KV head's queries 4 / 2 / 1 at a time): 4-6x torch's gather +
# scaled_dot_product_attention at 1-32 sequences (`evenflow bench kernels`). On AVX-512 builds
# its general loop serves other shapes up to this many sequences, torch's path above (torch's
# bf16 flash kernel caught up with that loop from ~16 sequences). Built for AVX2 the loop ran
# 0.24-0.45x torch's path from 2 sequences on (and 0.43-2.4x at one, by the run) under the
# AVX2 emulation: there torch's path serves every batch.
PAGED_ATTENTION_MAX_BATCH = 8

# A layer's cache as attention takes it: K, V, and an int8 cache's K and V scales (else None)
KVCacheParts = tuple[Tensor, Tensor, Tensor | None, Tensor | None]


@dataclass(frozen=True)
class AttentionKernels:
    """The native kernels one attention layer runs, chosen once when the runner is built (and
    again when it re-attaches a model after a kernel switch): forward asks nothing of native.*
    per call. None: torch's path serves."""

    rotary_kv_write: Any = None  # a decode-only step's rotary + K/V write + q's layout
    prefill: Any = None  # causal prefill attention over the paged cache
    decode: Any = None  # paged decode attention (where the runner picks it: decode_lens)
    kv_int8: Any = None  # an int8 cache's write and paged decode (kernels/kv_quant.cpp)

    @staticmethod
    def choose(layer: Attention, dtype: torch.dtype, cache_dtype: torch.dtype
               ) -> AttentionKernels:
        """What serves this layer in this dtype over a cache of `cache_dtype` (an int8 cache
        has kernels of its own: engine/model/kv_quant.py)."""
        hd, group = layer.head_dim, layer.num_heads // layer.num_kv_heads
        plain = not layer.qk_norm and layer.clip_qkv is None and layer.rotary_dim == hd
        same = cache_dtype == dtype
        prefill = native.prefill_attention() if same and native.prefill_attention_serves(
            dtype, hd, group) else None
        return AttentionKernels(native.rotary_kv_write() if plain and same else None, prefill,
                                native.decode_attention(),
                                native.kv_int8() if cache_dtype == torch.int8 else None)


def paged_decode_attention(batch: int, head_dim: int, group: int) -> bool:
    """Whether a decode step of `batch` sequences (heads of `head_dim`, `group` queries per KV
    head) runs the paged kernel (else torch's gathered attention, which alone needs the padding
    mask)."""
    if native.decode_attention() is None or not native.decode_attention_serves(head_dim):
        return False
    if native.decode_attention_registers(head_dim, group):
        return True
    return batch <= PAGED_ATTENTION_MAX_BATCH and native.built_for_avx512()


def gather_cache(cache: Tensor, scales: Tensor | None, slots: Tensor, dtype: torch.dtype
                 ) -> Tensor:
    """The cache's values at slots (any shape) -> (*slots.shape, n_kv, hd) in dtype (an int8
    cache's dequantized by its scales)."""
    if scales is not None:
        return gather_dequantized(cache, scales, slots, dtype)
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def gathered_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor,
                              mask: Tensor | None, k_scale: Tensor | None = None,
                              v_scale: Tensor | None = None) -> Tensor:
    """torch's decode attention: q (B, nh, hd) over each sequence's context slots (B, L),
    gathered into a padded copy, with an additive mask over the padding -> (B, nh, hd)."""
    B, (nh, hd), n_kv = slots.shape[0], q.shape[1:], k_cache.shape[1]
    # Queries sharing a KV head ride in the "query length" dimension: no KV expansion.
    qd = q.reshape(B, n_kv, nh // n_kv, hd)
    kd = gather_cache(k_cache, k_scale, slots, q.dtype).transpose(1, 2)  # (B, n_kv, L, hd)
    vd = gather_cache(v_cache, v_scale, slots, q.dtype).transpose(1, 2)
    return F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask).reshape(B, nh, hd)


def window_view(meta: AttentionMetadata, window: int) -> tuple[Tensor, Tensor]:
    """Each decoding sequence's slots and length as a sliding-window layer reads them: its last
    `window` slots (0: all of them). Made once per step and window (kept on `meta`)."""
    assert meta.decode_slots is not None and meta.decode_lens is not None
    if not window:
        return meta.decode_slots, meta.decode_lens
    if window not in meta.windows:
        lens = meta.decode_lens
        start = (lens - window).clamp(min=0)  # (B,)
        width = meta.decode_slots.shape[1]
        index = (torch.arange(width).unsqueeze(0) + start.unsqueeze(1)).clamp(max=width - 1)
        meta.windows[window] = (meta.decode_slots.gather(1, index).contiguous(), lens - start)
    return meta.windows[window]


def windowed_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor,
                       visible: Tensor | None, window: int, sinks: Tensor | None,
                       scale: float) -> Tensor:
    """q (B, nh, Lq, hd) at positions q_pos (B, Lq) over k / v (B, n_kv, L, hd) at k_pos
    (B, L): causal, within `window` tokens (0: no window), `visible` (B, L) masking padding;
    each head's sink logit (nh,) in the softmax's denominator -> (B, nh, Lq, hd).

    One scaled_dot_product_attention call with an additive mask: a sink is one more key of
    zeros (score 0) and value zeros whose mask entry is the head's sink logit — it adds
    exp(sink) to the denominator and nothing to the output (3x the explicit softmax at 2,048
    tokens)."""
    delta = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)  # (B, Lq, L)
    allowed = delta >= 0
    if window:
        allowed &= delta < window
    if visible is not None:
        allowed &= visible.unsqueeze(1)
    B, nh, Lq = q.shape[:3]
    mask = torch.zeros(*allowed.shape, dtype=q.dtype).masked_fill_(~allowed, float("-inf"))
    mask = mask.unsqueeze(1)  # (B, 1, Lq, L)
    if sinks is not None:
        sink = sinks.to(q.dtype).view(1, nh, 1, 1).expand(B, nh, Lq, 1)
        mask = torch.cat([mask.expand(B, nh, Lq, -1), sink], dim=-1)
        k, v = F.pad(k, (0, 0, 0, 1)), F.pad(v, (0, 0, 0, 1))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=True)


class Attention(nn.Module):
    """q, k and v come from one fused projection (qkv_proj: the loader concatenates the
    checkpoint's q_proj, k_proj and v_proj)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.scale
        self.rotary_dim = cfg.rotary_dim  # < head_dim: partial rotary (the first dims)
        self.window = cfg.window(layer)
        # one learned logit per head, in every softmax's denominator (GPT-OSS)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if cfg.attention_sinks else None
        self._sinks32: Tensor | None = None  # (the paged kernel's float32 copy)
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, qkv_out, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size,
                                bias=cfg.o_proj_bias)
        if cfg.qk_norm:  # per head, or over the whole q and k projections (qk_norm_whole)
            q_dim, k_dim = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim) \
                if cfg.qk_norm_whole else (cfg.head_dim, cfg.head_dim)
            self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps)
        self.qk_norm, self.qk_norm_whole, self.clip_qkv = \
            cfg.qk_norm, cfg.qk_norm_whole, cfg.clip_qkv
        self.qk_norm_after_rope = cfg.qk_norm_after_rope
        # Tensor parallel (engine/weights/tp_shard.py): a norm over the whole projection sums
        # its squares over every rank's heads
        self.tp: ProcessGroup | None = None
        self.kernels = AttentionKernels()  # torch's until a runner chooses (ModelRunner.attach)

    def forward(
        self,
        x: Tensor,  # (T, H)
        cos: Tensor,  # (T, 1, hd)
        sin: Tensor,  # (T, 1, hd), first half negated
        k_cache: Tensor,  # (num_slots, n_kv, hd)
        v_cache: Tensor,
        meta: AttentionMetadata,
        k_scale: Tensor | None = None,  # an int8 cache's scales (engine/model/kv_quant.py)
        v_scale: Tensor | None = None,
    ) -> Tensor:
        T, nh, n_kv, hd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.window and meta.sliding is not None:  # its cache is the sliding layers' pool
            meta = meta.sliding
        qkv = self.qkv_proj(x).view(T, nh + 2 * n_kv, hd)
        fused = self.kernels.rotary_kv_write if not meta.prefills else None
        if fused is not None and qkv.is_contiguous() and qkv.dtype == cos.dtype == k_cache.dtype:
            # a decode-only step: rotary, the K/V write and q's layout in one pass
            q = fused(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, nh, n_kv)
            out = self._decode_attention(q, (k_cache, v_cache, None, None), meta)
            return self.o_proj(out.reshape(T, nh * hd))
        q, k, v = self._rotated_qkv(qkv, cos, sin)  # (T, nh | n_kv | n_kv, hd)
        cache = (k_cache, v_cache, k_scale, v_scale)
        if k_scale is not None and v_scale is not None:
            write_quantized(k, k_cache, k_scale, meta.slot_mapping, self.kernels.kv_int8)
            write_quantized(v, v_cache, v_scale, meta.slot_mapping, self.kernels.kv_int8)
        else:
            k_cache.index_copy_(0, meta.slot_mapping, k)
            v_cache.index_copy_(0, meta.slot_mapping, v)
        kernel = self.kernels.prefill if meta.prefills and q.dtype == k_cache.dtype and \
            k_cache.is_contiguous() and v_cache.is_contiguous() else None
        if (self.window or self.sinks is not None) and meta.prefills and kernel is None:
            return self.o_proj(self._windowed(q, k, v, cache, meta).reshape(T, nh * hd))
        outs = self._prefills(q, k, v, cache, meta, kernel)
        if meta.decode_slots is not None:
            outs.append(self._decode_attention(q[meta.num_prefill_tokens :], cache, meta))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))

    def _rotated_qkv(self, qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v from the fused projection: q/k norms (before or after rotary, per head or
        whole), clipping, and rotary on the rotary dims."""
        T, nh, n_kv, hd = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qk, v = qkv[:, : nh + n_kv], qkv[:, nh + n_kv :]  # (T, nh + n_kv, hd), (T, n_kv, hd)
        if self.qk_norm_whole:
            q, k = qk[:, :nh].reshape(T, nh * hd), qk[:, nh:].reshape(T, n_kv * hd)
            if self.tp is None:
                q, k = self.q_norm(q), self.k_norm(k)
            else:
                q, k = self._sharded_norms(q, k)
            qk = torch.cat([q.view(T, nh, hd), k.view(T, n_kv, hd)], dim=1)
        elif self.qk_norm and not self.qk_norm_after_rope:
            qk = torch.cat([self.q_norm(qk[:, :nh]), self.k_norm(qk[:, nh:])], dim=1)
        if self.clip_qkv is not None:
            qk, v = qk.clamp(-self.clip_qkv, self.clip_qkv), v.clamp(-self.clip_qkv, self.clip_qkv)
        # rotary on q and k heads at once: rotate_half(x) * sin == roll(x, hd/2) * signed sin
        # (bitwise; one op instead of four)
        if self.rotary_dim == hd:
            qk = qk * cos + torch.roll(qk, hd // 2, -1) * sin
        else:
            rot = qk[..., : self.rotary_dim]
            rot = rot * cos + torch.roll(rot, self.rotary_dim // 2, -1) * sin
            qk = torch.cat([rot, qk[..., self.rotary_dim :]], dim=-1)
        if self.qk_norm_after_rope:
            qk = torch.cat([self.q_norm(qk[:, :nh]), self.k_norm(qk[:, nh:])], dim=1)
        return qk[:, :nh], qk[:, nh:], v  # (T, nh, hd), (T, n_kv, hd), (T, n_kv, hd)

    def _prefills(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCacheParts,
                  meta: AttentionMetadata, kernel: Any) -> list[Tensor]:
        """Each prefill segment's attention (q_len, nh, hd): the native kernel over the cache
        where it serves, else torch's flash kernel (with a causal mask offset by the cached
        part when the context comes from the cache)."""
        k_cache, v_cache, k_scale, v_scale = cache
        outs: list[Tensor] = []
        for seg in meta.prefills:
            if kernel is not None:  # over the cache, where K and V were just written
                slots = seg.slots if seg.slots is not None else \
                    meta.slot_mapping[seg.q_start : seg.q_start + seg.q_len]
                outs.append(kernel(q[seg.q_start : seg.q_start + seg.q_len], k_cache, v_cache,
                                   slots, self.scale, self.window, self._sinks_f32()))
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
                ks = gather_cache(k_cache, k_scale, seg.slots, q.dtype).transpose(0, 1)[None]
                vs = gather_cache(v_cache, v_scale, seg.slots, q.dtype).transpose(0, 1)[None]
                offset = seg.ctx_len - seg.q_len
                q_pos = torch.arange(seg.q_len).unsqueeze(1) + offset
                mask = torch.arange(seg.ctx_len).unsqueeze(0) <= q_pos  # (q, ctx)
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
            outs.append(o[0].transpose(0, 1))  # (q, nh, hd)
        return outs

    def _windowed(self, q: Tensor, k: Tensor, v: Tensor, cache: KVCacheParts,
                  meta: AttentionMetadata) -> Tensor:
        """Every segment's and decoding sequence's attention through windowed_attention."""
        k_cache, v_cache, k_scale, v_scale = cache
        outs: list[Tensor] = []
        for seg in meta.prefills:
            rows = slice(seg.q_start, seg.q_start + seg.q_len)
            if seg.slots is None:
                ks, vs = k[rows], v[rows]
            else:
                ks = gather_cache(k_cache, k_scale, seg.slots, q.dtype)
                vs = gather_cache(v_cache, v_scale, seg.slots, q.dtype)
            q_pos = torch.arange(seg.ctx_len - seg.q_len, seg.ctx_len).unsqueeze(0)
            o = windowed_attention(q[rows].transpose(0, 1).unsqueeze(0),
                                   ks.transpose(0, 1).unsqueeze(0),
                                   vs.transpose(0, 1).unsqueeze(0), q_pos,
                                   torch.arange(seg.ctx_len).unsqueeze(0), None,
                                   self.window, self.sinks, self.scale)
            outs.append(o[0].transpose(0, 1))
        if meta.decode_slots is not None:
            outs.append(self._decode_attention(q[meta.num_prefill_tokens :], cache, meta))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    def _windowed_decode(self, q: Tensor, cache: KVCacheParts, meta: AttentionMetadata
                         ) -> Tensor:
        """Torch's decode attention for a windowed or sink layer, where the runner picked the
        gathered path (no paged kernel): q (B, nh, hd) -> (B, nh, hd)."""
        k_cache, v_cache, k_scale, v_scale = cache
        assert meta.decode_slots is not None and meta.decode_mask is not None
        slots = meta.decode_slots
        B, L = slots.shape
        visible = meta.decode_mask.view(B, L) == 0
        lens = visible.sum(-1, keepdim=True)  # (B, 1): context lengths
        kd = gather_cache(k_cache, k_scale, slots, q.dtype).transpose(1, 2)
        vd = gather_cache(v_cache, v_scale, slots, q.dtype).transpose(1, 2)
        o = windowed_attention(q.unsqueeze(2), kd, vd, lens - 1,
                               torch.arange(L).unsqueeze(0).expand(B, L), visible,
                               self.window, self.sinks, self.scale)
        return o[:, :, 0]

    def _sinks_f32(self) -> Tensor | None:
        """The sink logits as the paged kernel reads them (float32, contiguous), kept."""
        if self.sinks is None:
            return None
        if self._sinks32 is None or self._sinks32.shape != self.sinks.shape:
            self._sinks32 = self.sinks.detach().float().contiguous()
        return self._sinks32

    def _sharded_norms(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """RMSNorm of this rank's slices of q and k by the whole projections' mean squares
        (one all-reduce of both sums), in float32 as transformers' RMSNorm computes it."""
        assert self.tp is not None
        world = self.tp.world_size
        q32, k32 = q.float(), k.float()
        sums = torch.stack([q32.pow(2).sum(-1), k32.pow(2).sum(-1)])  # (2, T)
        self.tp.all_reduce(sums)
        q_var = sums[0].unsqueeze(-1) / (q.shape[-1] * world)
        k_var = sums[1].unsqueeze(-1) / (k.shape[-1] * world)
        eps = self.q_norm.eps
        q = self.q_norm.weight * (q32 * torch.rsqrt(q_var + eps)).to(q.dtype)
        k = self.k_norm.weight * (k32 * torch.rsqrt(k_var + eps)).to(k.dtype)
        return q, k

    def _decode_attention(self, q: Tensor, cache: KVCacheParts, meta: AttentionMetadata
                          ) -> Tensor:
        """q (B, nh, hd): each decoding sequence's one query over its context -> (B, nh, hd)."""
        assert meta.decode_slots is not None
        k_cache, v_cache, k_scale, v_scale = cache
        if meta.decode_lens is not None:  # K and V read where they lie (paged_attention.cpp)
            slots, lens = window_view(meta, self.window)
            sinks = self._sinks_f32()
            if k_scale is not None and v_scale is not None:
                return paged_decode_attention_int8(self.kernels.kv_int8, q.contiguous(), k_cache,
                                                   v_cache, k_scale, v_scale, slots, lens,
                                                   self.scale, sinks)
            paged = self.kernels.decode
            assert paged is not None, "the runner picked the paged kernel: it chose one"
            return paged(q.contiguous(), k_cache, v_cache, slots, lens, self.scale, sinks)
        if self.window or self.sinks is not None:
            return self._windowed_decode(q, cache, meta)
        return gathered_decode_attention(q, k_cache, v_cache, meta.decode_slots,
                                         meta.decode_mask, k_scale, v_scale)
