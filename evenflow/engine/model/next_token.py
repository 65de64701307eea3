"""A checkpoint's next-token prediction layer (DeepSeek-V3's and GLM-4.5's multi-token
prediction, MTP: `num_nextn_predict_layers`), as a one-layer model that speculative decoding's
`mtp` method drafts with (engine/serving/draft_model.py).

The layer at position p combines the target model's final hidden state h_p (after its last
norm) with the embedding of the token at p + 1, and predicts the token at p + 2:
    x = eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)]),  x = decoder_layer(x),
    logits = shared_head.head(shared_head.norm(x))
with the target's embedding and lm_head (the checkpoint's copies of them are equal and not
loaded). Its decoder layer is the family's own (MLA and DeepSeek's MoE for V3) with a KV cache
of its own. A second draft token feeds the layer its own output hidden state, as vLLM does.
As in vLLM, the embedding is zeroed at position 0. Loading: engine/weights/next_token.py.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor, nn

from evenflow.engine.config.settings import ModelConfig
from evenflow.engine.model.metadata import AttentionMetadata
from evenflow.engine.model.norm import layer_norm
from evenflow.engine.model.transformer import CausalLM


def next_token_config(cfg: ModelConfig) -> ModelConfig:
    """The one-layer model's config: the target's, its only layer shaped as the stored layer
    after the decoder's (routed experts where the decoder's last layer has them)."""
    return replace(cfg, num_layers=1, sparse_layers=cfg.sparse_layers[-1:],
                   layer_windows=cfg.layer_windows[-1:], num_nextn_predict_layers=0)


class NextTokenModel(CausalLM):
    """forward as CausalLM's, with `hidden` (the rows' previous hidden states, (T, H)) and
    `first_rows` (rows at absolute position 0) set by the caller for the step; keeps the
    scored rows' output hidden states in `out_hidden` (the next draft step's input)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = layer_norm(cfg.norm_kind, H, eps)
        self.hnorm = layer_norm(cfg.norm_kind, H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.hidden: Tensor | None = None
        self.first_rows: Tensor | None = None
        self.out_hidden: Tensor | None = None

    def share_with(self, target: CausalLM) -> None:
        """The target's embedding and lm_head (and its tensor-parallel vocabulary split)."""
        self.model.embed_tokens, self.lm_head = target.model.embed_tokens, target.lm_head
        self.tp, self.vocab_start, self.vocab_rows = target.tp, target.vocab_start, \
            target.vocab_rows

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[tuple[Tensor, ...]],
                meta: AttentionMetadata, logit_rows: Tensor) -> Tensor:
        assert self._cos is not None and self._sin is not None, "call init_rope first"
        assert self.hidden is not None and len(self.hidden) == len(input_ids)
        cos = self._cos.index_select(0, positions).unsqueeze(1)
        sin = self._sin.index_select(0, positions).unsqueeze(1)
        embedded = self._embed(input_ids)
        if self.first_rows is not None and bool(self.first_rows.any()):
            embedded = embedded.masked_fill(self.first_rows.unsqueeze(1), 0.0)
        x = self.eh_proj(torch.cat([self.enorm(embedded),
                                    self.hnorm(self.hidden.to(embedded.dtype))], dim=-1))
        x, pending = self.model.layers[0](x, cos, sin, kv_caches[0], meta, None)
        if len(logit_rows) != len(x):
            x, pending = x[logit_rows], pending[logit_rows]
        out, h = self.model.norm.add_and_norm(pending, x)
        self.out_hidden = out
        return self._logits(h)
