"""The decoder wired from a ModelConfig: one model for every family engine/config/families.py reads
(their differences are config switches: attention is grouped-query or latent (MLA), the
feed-forward dense or routed experts).

Tokens of all sequences in a step are flattened into one batch (T tokens). Attention reads and
writes a paged KV cache through slot indices (slot = block_id * block_size + offset); MoE layers
route each token to its top-k experts, group tokens by expert and run one matmul per expert.
Module names follow the HF checkpoints, so loading is a rename only where experts are stacked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from evenflow.engine.config.settings import ModelConfig
from evenflow.engine.model.attention import Attention
from evenflow.engine.model.metadata import AttentionMetadata
from evenflow.engine.model.mla import LatentAttention
from evenflow.engine.model.mlp import MLP
from evenflow.engine.model.moe import MoE
from evenflow.engine.model.norm import layer_norm
from evenflow.engine.model.rotary import rope_tables
from evenflow.parallel.group import ProcessGroup


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.self_attn: Attention | LatentAttention = \
            LatentAttention(cfg) if cfg.mla else Attention(cfg, index)
        self.mlp: nn.Module = MoE(cfg) if cfg.sparse_layers[index] else \
            MLP(cfg.hidden_size, cfg.intermediate_size)
        H, eps, kind = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_kind
        # Pre-norms: input_layernorm before attention, post_attention_layernorm before the
        # MLP. Post-norms (OLMo 2's): post_attention_layernorm on attention's output,
        # post_feedforward_layernorm on the MLP's, each before its residual add.
        self.post_norms = cfg.norm_placement == "post"
        self.input_layernorm = None if self.post_norms else layer_norm(kind, H, eps)
        self.post_attention_layernorm = layer_norm(kind, H, eps)
        self.post_feedforward_layernorm = layer_norm(kind, H, eps) if self.post_norms else None
        # Tensor parallel (engine/weights/tp_shard.py): attention and MLP give partial sums
        self.tp: ProcessGroup | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: tuple[Tensor, ...],
                meta: AttentionMetadata, pending: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
        """x: the residual stream; pending: the layer before's MLP output, not yet added to it
        (the add is fused into this layer's first norm, as the attention output's is into the
        second). -> (the residual stream, this layer's MLP output: the next layer's pending)."""
        if self.post_norms:
            return self._post_norm_forward(x, cos, sin, kv, meta, pending)
        assert self.input_layernorm is not None
        if pending is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm.add_and_norm(pending, x)
        attn = self._attend(h, cos, sin, kv, meta)
        if self.tp is not None:
            self.tp.all_reduce(attn)
        x, h = self.post_attention_layernorm.add_and_norm(x, attn)
        mlp = self.mlp(h)
        if self.tp is not None:
            self.tp.all_reduce(mlp)
        return x, mlp

    def _attend(self, h: Tensor, cos: Tensor, sin: Tensor, kv: tuple[Tensor, ...],
                meta: AttentionMetadata) -> Tensor:
        """kv: (K, V), an int8 cache's (K, V, K scales, V scales), MLA's (latent,) or its int8
        (latent, scales)."""
        if isinstance(self.self_attn, LatentAttention):
            return self.self_attn(h, cos, sin, kv[0], meta, *kv[1:])
        return self.self_attn(h, cos, sin, *kv[:2], meta, *kv[2:])

    def _post_norm_forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: tuple[Tensor, ...],
                           meta: AttentionMetadata, pending: Tensor | None
                           ) -> tuple[Tensor, Tensor]:
        """forward with post-norms: x + norm(attention(x)), then norm(mlp(x)) as pending."""
        assert self.post_feedforward_layernorm is not None
        if pending is not None:
            x = x + pending
        attn = self._attend(x, cos, sin, kv, meta)
        if self.tp is not None:
            self.tp.all_reduce(attn)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(x)
        if self.tp is not None:
            self.tp.all_reduce(mlp)
        return x, self.post_feedforward_layernorm(mlp)


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
               kv: tuple[Tensor, ...]) -> bool:
        ...

    def step(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
             meta: AttentionMetadata) -> Tensor:  # (T, vocab) float32
        ...

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor,
                 kv_caches: list[tuple[Tensor, ...]], meta: AttentionMetadata
                 ) -> tuple[Tensor, Tensor]:
        ...


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = layer_norm(cfg.norm_kind, cfg.hidden_size, cfg.rms_norm_eps)


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
        # keep_hidden: each forward keeps every row's final hidden state (after the last norm)
        # in hidden_rows, for speculative decoding's next-token layer (model/next_token.py)
        self.keep_hidden = False
        self.hidden_rows: Tensor | None = None
        # LoRA adapters (model/lora.py Adapters), made when the first one is loaded
        self.adapters: Any = None

    def set_tensor_parallel(self, group: ProcessGroup) -> None:
        self.tp = group
        for layer in self.decoder_layers():
            layer.tp = layer.self_attn.tp = group

    def decoder_layers(self) -> list[DecoderLayer]:
        return [layer for layer in self.model.layers if isinstance(layer, DecoderLayer)]

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank's cache holds."""
        return self.decoder_layers()[0].self_attn.num_kv_heads

    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    def init_rope(self, max_len: int, dtype: torch.dtype) -> None:
        self._cos, self._sin = rope_tables(self.config.rotary_dim, self.config.rope_theta,
                                           max_len, dtype, self.config.rope)

    def forward(
        self,
        input_ids: Tensor,  # (T,)
        positions: Tensor,  # (T,)
        kv_caches: list[tuple[Tensor, ...]],
        meta: AttentionMetadata,
        logit_rows: Tensor,  # (S,) rows of the flat batch whose next token is sampled
    ) -> Tensor:  # (S, vocab) float32
        assert self._cos is not None and self._sin is not None, "call init_rope first"
        adapting = self.adapters is not None and self.adapters.step is not None
        fast = None if adapting else self._fast_decode(meta, kv_caches)
        if fast is not None and len(logit_rows) == len(input_ids) and fast.head_usable() and \
                not self.keep_hidden:
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
        if self.keep_hidden:
            h = self.model.norm(x) if pending is None else \
                self.model.norm.add_and_norm(pending, x)[1]
            self.hidden_rows = h
            return self._logits(h if len(logit_rows) == len(h) else h[logit_rows])
        if len(logit_rows) != len(x):  # (rows are ascending and distinct: else every row)
            x = x[logit_rows]
            pending = None if pending is None else pending[logit_rows]
        if pending is None:  # (no layers)
            return self._logits(self.model.norm(x))
        _, h = self.model.norm.add_and_norm(pending, x)
        return self._logits(h)

    def _fast_decode(self, meta: AttentionMetadata, kv_caches: list[tuple[Tensor, ...]]
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
