"""Multi-head latent attention (MLA, DeepSeek-V2 / -V3) over the paged cache.

Each token's keys and values are compressed into one latent: kv_lora_rank dims (normalized)
plus qk_rope_head_dim rotary dims shared by every head. The cache holds that latent, one
(num_slots, 1, kv_lora_rank + rope) tensor per layer — not K and V per head — so a token costs
(kv_lora_rank + rope) elements per layer whatever the head count.

- Prefill (expanded form): the context's latents go up through kv_b_proj into per-head keys
  (nope part; the rope part is shared) and values; causal attention as usual (the native
  prefill kernel where it serves the head width, else torch's SDPA).
- Decode (absorbed form, as vLLM's and SGLang's MLA backends): each query's nope part is
  multiplied into the latent space by kv_b_proj's key half (q_lat = q_nope W_uk), attends over
  the cached latents directly (one shared "KV head" of kv_lora_rank + rope dims), and the
  latent output goes up through the value half (W_uv). No per-head K/V is ever built.

DeepSeek's rotary dims come in interleaved pairs (x0, x1), (x2, x3), ...: q's and the latent's
rope parts are reordered to evens then odds before the rotate-half rotary (the same dot
products as transformers' interleaved rotation; the cache holds them reordered).

Under tensor parallelism (engine/weights/tp_shard.py) each rank keeps its heads' rows of q and
kv_b_proj and o_proj's matching columns; the latent projection and the latent cache are whole
on every rank (the latent is shared by all heads: splitting it would cost an all-reduce per
attention, and a rank's cache would still need every dim to score its heads).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from evenflow.engine.config.settings import ModelConfig
from evenflow.engine.model.attention import gather_cache
from evenflow.engine.model.kv_quant import block_size_of, write_quantized
from evenflow.engine.model.metadata import AttentionMetadata
from evenflow.engine.model.norm import RMSNorm

# DeepSeek's q_a / kv_a norms keep transformers' default epsilon (not rms_norm_eps)
LATENT_NORM_EPS = 1e-6


class LatentUpProjection(nn.Module):
    """kv_b_proj: latent -> every head's k_nope and v. Not an nn.Linear on purpose: decode reads
    its weight as two per-head stacks (the absorbed form), so packing (engine/weights/
    prepack.py) and quantization leave it plain.

    Held with its rows regrouped: every head's key rows, then every head's value rows (the
    checkpoint interleaves them head by head). W_uk and W_uv are then two contiguous (heads, .,
    rank) stacks: decode's two batched matmuls read them in place, where per-head views of the
    checkpoint's layout made torch copy 2 x 2 MB a layer per step (at DeepSeek-V3's width,
    batch 1: 0.74 ms a layer before, 0.11 after). Loading regroups (`_load_from_state_dict`),
    so `state_dict()` gives the regrouped layout."""

    def __init__(self, rank: int, heads: int, nope: int, v_dim: int) -> None:
        super().__init__()
        self.heads, self.nope, self.v_dim = heads, nope, v_dim
        self.weight = nn.Parameter(torch.empty(heads * (nope + v_dim), rank))

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: object) -> None:
        key = prefix + "weight"
        if key in state_dict:  # (a checkpoint's layout, by head)
            state_dict = {**state_dict, key: self.regrouped(state_dict[key])}
        super()._load_from_state_dict(state_dict, prefix, *args)  # type: ignore[arg-type]

    def regrouped(self, by_head: Tensor) -> Tensor:
        w = by_head.view(self.heads, self.nope + self.v_dim, by_head.shape[-1])
        return torch.cat([w[:, : self.nope].reshape(-1, w.shape[-1]),
                          w[:, self.nope :].reshape(-1, w.shape[-1])])

    @property
    def w_uk(self) -> Tensor:  # (heads, nope, rank)
        return self.weight[: self.heads * self.nope].view(self.heads, self.nope, -1)

    @property
    def w_uv(self) -> Tensor:  # (heads, v_dim, rank)
        return self.weight[self.heads * self.nope :].view(self.heads, self.v_dim, -1)

    def for_heads(self, first: int, count: int) -> LatentUpProjection:
        """Heads [first, first + count) alone (a tensor-parallel rank's)."""
        up = LatentUpProjection(self.weight.shape[1], count, self.nope, self.v_dim)
        up.weight = nn.Parameter(torch.cat([self.w_uk[first : first + count].flatten(0, 1),
                                            self.w_uv[first : first + count].flatten(0, 1)]),
                                 requires_grad=False)
        return up

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (L, rank) -> k_nope (L, heads, nope), v (L, heads, v_dim)."""
        y = F.linear(x, self.weight)
        keys = self.heads * self.nope
        return y[:, :keys].view(-1, self.heads, self.nope), \
            y[:, keys:].view(-1, self.heads, self.v_dim)


class LatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H, nh = cfg.hidden_size, cfg.num_heads
        self.num_heads = nh
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, \
            cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        qk = self.nope + self.rope
        self.q_proj: nn.Module | None = None
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(H, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * qk, bias=False)
        else:
            self.q_proj = nn.Linear(H, nh * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, self.rank + self.rope, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentUpProjection(self.rank, nh, self.nope, self.v_dim)
        # the native absorbed decode (kernels/mla_decode.cpp) and the native causal prefill
        # attention (kernels/prefill_attention.cpp, over the expanded K and V), chosen by the
        # runner (attach)
        self.decode_kernels: Any = None
        self.prefill_kernel: Any = None
        self.kv_int8_kernels: Any = None  # an int8 latent cache's write (kernels/kv_quant.cpp)
        self.o_proj = nn.Linear(nh * self.v_dim, H, bias=cfg.o_proj_bias)
        self.scale = cfg.scale
        self.interleaved = cfg.rope_interleave

    @property
    def num_kv_heads(self) -> int:
        return 1  # the latent

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: Tensor,
                meta: AttentionMetadata, scales: Tensor | None = None) -> Tensor:
        """x (T, H); cos / sin (T, 1, rope); cache: this layer's latents (slots, 1, r + rope),
        int8 with `scales` (blocks + 1, 1) under kv_cache_dtype int8 (engine/model/kv_quant.py:
        the latent is one part of one head)."""
        T, nh = x.shape[0], self.num_heads
        q = self.q_proj(x) if self.q_proj is not None else \
            self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, nh, self.nope + self.rope)
        q_nope, q_pe = q[..., : self.nope], self._rotate(q[..., self.nope :], cos, sin)
        kv = self.kv_a_proj_with_mqa(x)
        latent = torch.cat([self.kv_a_layernorm(kv[:, : self.rank]).unsqueeze(1),
                            self._rotate(kv[:, self.rank :].unsqueeze(1), cos, sin)], dim=-1)
        if scales is not None:
            write_quantized(latent, cache, scales, meta.slot_mapping, self.kv_int8_kernels)
        else:
            cache.index_copy_(0, meta.slot_mapping, latent.to(cache.dtype))
        outs = [self._prefill(q_nope[s.q_start : s.q_start + s.q_len],
                              q_pe[s.q_start : s.q_start + s.q_len],
                              latent[s.q_start : s.q_start + s.q_len] if s.slots is None
                              else gather_cache(cache, scales, s.slots, latent.dtype),
                              s.ctx_len - s.q_len)
                for s in meta.prefills]
        if meta.decode_slots is not None:
            P = meta.num_prefill_tokens
            outs.append(self._decode(q_nope[P:], q_pe[P:], cache, scales, meta))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        return self.o_proj(out.reshape(T, nh * self.v_dim))

    def _prefill(self, q_nope: Tensor, q_pe: Tensor, ctx: Tensor, offset: int) -> Tensor:
        """Expanded form: the context's latents (L, 1, rank + rope) up to per-head K and V;
        queries q_len, at positions offset.. -> (q_len, nh, v_dim)."""
        L, nh, q_len = ctx.shape[0], self.num_heads, q_nope.shape[0]
        k_nope, v = self.kv_b_proj(ctx[:, 0, : self.rank])
        k = torch.cat([k_nope, ctx[:, :, self.rank :].expand(L, nh, self.rope)], dim=-1)
        if self.v_dim < self.nope + self.rope:
            # V zero-padded to the query's width: torch's CPU flash kernel wants one head dim
            # (else its math path materializes every score: 4.5x slower at 2,048 tokens)
            v = F.pad(v, (0, self.nope + self.rope - self.v_dim))
        q = torch.cat([q_nope, q_pe], dim=-1)
        if self.prefill_kernel is not None and v.shape[-1] == q.shape[-1]:
            # the expanded K and V stand in for a cache of L slots, in order; torch's flash
            # kernel ran this at a quarter of the native kernel's speed (2,048 tokens, 16 heads
            # of 128: over 80% of DeepSeek-V3's 110M prefill step)
            o = self.prefill_kernel(
                q, k.contiguous(), v.contiguous(), torch.arange(L), self.scale)
            return o[..., : self.v_dim]
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if offset == 0:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=self.scale)
        else:
            mask = torch.arange(L).unsqueeze(0) <= torch.arange(q_len).unsqueeze(1) + offset
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=self.scale)
        return o[0, ..., : self.v_dim].transpose(0, 1)

    def _decode(self, q_nope: Tensor, q_pe: Tensor, cache: Tensor, scales: Tensor | None,
                meta: AttentionMetadata) -> Tensor:
        """Absorbed form: (B, nh, nope) queries into the latent space, attention over the
        cached latents (B, L) as one shared head, the output up through W_uv -> (B, nh, v).
        The native kernel (kernels/mla_decode.cpp) where the runner picked it (decode_lens),
        else torch's."""
        assert meta.decode_slots is not None
        w_uk, w_uv = self.kv_b_proj.w_uk, self.kv_b_proj.w_uv
        if meta.decode_lens is not None:
            kernels = self.decode_kernels
            if kernels is not None and w_uk.dtype == q_nope.dtype == cache.dtype:
                return kernels.mla_decode(q_nope, q_pe, w_uk, w_uv, cache, meta.decode_slots,
                                          meta.decode_lens, self.scale)
            if kernels is not None and scales is not None and w_uk.dtype == q_nope.dtype:
                return kernels.mla_decode_int8(q_nope, q_pe, w_uk, w_uv, cache, scales,
                                               meta.decode_slots, meta.decode_lens, self.scale,
                                               block_size_of(cache, scales))
        return self._torch_decode(q_nope, q_pe, cache, scales, meta)

    def _torch_decode(self, q_nope: Tensor, q_pe: Tensor, cache: Tensor, scales: Tensor | None,
                      meta: AttentionMetadata) -> Tensor:
        """torch's absorbed decode: two bmm's around SDPA over a gathered, padded copy."""
        assert meta.decode_slots is not None
        B, L = meta.decode_slots.shape
        mask = meta.decode_mask
        if mask is None:  # the runner chose the kernel, which does not take this dtype mix
            assert meta.decode_lens is not None
            real = torch.arange(L) < meta.decode_lens.unsqueeze(1)
            mask = torch.zeros(B, 1, 1, L, dtype=q_nope.dtype).masked_fill_(
                ~real.view(B, 1, 1, L), float("-inf"))
        nh, width = self.num_heads, self.rank + self.rope
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.kv_b_proj.w_uk).transpose(0, 1)
        q = torch.cat([q_lat, q_pe], dim=-1).unsqueeze(1)  # (B, 1, nh, r + rope)
        ctx = gather_cache(cache, scales, meta.decode_slots.flatten(), q.dtype).view(
            B, 1, L, width)
        # V is the latent itself: passed whole (the rope dims' output is dropped after), so
        # q, K and V share one width and torch's flash kernel takes them (its math path,
        # for unequal widths, upcasts everything: 60% of a batch-32 step)
        o = F.scaled_dot_product_attention(q, ctx, ctx, attn_mask=mask,
                                           scale=self.scale)[..., : self.rank]
        o = o.reshape(B, nh, self.rank).permute(1, 2, 0).contiguous()  # (nh, r, B)
        # W_uv (nh, v, r) @ o: the weight read in place (o's transpose is the small copy)
        return torch.bmm(self.kv_b_proj.w_uv, o).permute(2, 0, 1)  # (B, nh, v)

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate-half rotary (sin's first half negated: one multiply-add with a roll), the
        interleaved pairs first reordered to evens then odds."""
        if self.interleaved:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin
