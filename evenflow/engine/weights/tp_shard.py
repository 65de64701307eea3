"""Which part of each weight a tensor-parallel rank keeps (Megatron-style), applied to a loaded
layer in place:

- attention: rank r keeps query heads [r*nh/N, (r+1)*nh/N) and the KV heads they read (split
  like the query heads when N <= num_kv_heads, else the one KV head its query heads share,
  replicated on N / num_kv_heads ranks), and their sinks; o_proj keeps the matching input
  columns. MLA: its heads' rows of q and kv_b_proj; the latent projection (and so the latent
  cache) stays whole on every rank;
- dense MLPs, shared experts and every routed expert: gate/up keep a slice of the intermediate
  rows (and of their biases), down the same input columns (torch.tensor_split: any width works);
  a bias after a partial sum (o_proj's, down's) is added by rank 0 only;
- the embedding and lm_head keep a slice of the vocabulary, padded to ceil(V/N) rows so every
  rank's logits have one shape for the all-gather.

So a layer's attention output and MLP/MoE output are partial sums: the model all-reduces each
(two per layer). Norms and the router stay whole on every rank, so routing is identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from evenflow.engine.config.settings import ModelConfig, ModelLoadError
from evenflow.engine.model.attention import Attention
from evenflow.engine.model.mla import LatentAttention
from evenflow.engine.model.mlp import MLP
from evenflow.engine.model.moe import MoE
from evenflow.engine.model.transformer import CausalLM, DecoderLayer


@dataclass(frozen=True)
class TPShard:
    rank: int
    world_size: int

    def check(self, cfg: ModelConfig) -> None:
        """ModelLoadError unless this model splits over world_size ranks."""
        n = self.world_size
        if cfg.num_heads % n:
            raise ModelLoadError(f"tensor_parallel_size {n} must divide the model's "
                                 f"{cfg.num_heads} attention heads")
        if cfg.qk_norm_whole and cfg.num_kv_heads % n:
            raise ModelLoadError(f"tensor_parallel_size {n} must divide {cfg.architecture}'s "
                                 f"{cfg.num_kv_heads} KV heads: its k norm spans them all")
        if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
            raise ModelLoadError(f"tensor_parallel_size {n} and the model's {cfg.num_kv_heads} "
                                 f"KV heads must divide one another")

    def kv_heads(self, cfg: ModelConfig) -> list[int]:
        """The KV heads this rank keeps (global indices)."""
        n, nkv = self.world_size, cfg.num_kv_heads
        if nkv >= n:
            per = nkv // n
            return list(range(self.rank * per, (self.rank + 1) * per))
        return [self.rank * nkv // n]

    def _part(self, t: Tensor, dim: int) -> Tensor:
        # a copy of its own: a view would keep the whole weight alive
        return t.tensor_split(self.world_size, dim=dim)[self.rank].clone(
            memory_format=torch.contiguous_format)

    def shard_layer(self, layer: DecoderLayer, cfg: ModelConfig) -> None:
        attn = layer.self_attn
        if isinstance(attn, LatentAttention):
            self._shard_latent_attention(attn, cfg)
        else:
            self._shard_attention(attn, cfg)
        mlp = layer.mlp
        if isinstance(mlp, MLP):
            self._shard_mlp(mlp)
        elif isinstance(mlp, MoE):
            half = mlp.w13.shape[1] // 2
            gate, up = mlp.w13.data[:, :half], mlp.w13.data[:, half:]
            mlp.w13 = _param(torch.cat([self._part(gate, 1), self._part(up, 1)], dim=1))
            mlp.w2 = _param(self._part(mlp.w2.data, 2))
            if mlp.b13 is not None and mlp.b2 is not None:
                gate_b, up_b = mlp.b13.data[:, :half], mlp.b13.data[:, half:]
                mlp.b13 = _param(torch.cat([self._part(gate_b, 1), self._part(up_b, 1)], dim=1))
                mlp.b2 = _param(mlp.b2.data.clone() if self.rank == 0 else
                                torch.zeros_like(mlp.b2.data))
            if mlp.shared_expert is not None:
                self._shard_mlp(mlp.shared_expert)

    def _heads(self, num_heads: int, width: int) -> Tensor:
        """The rows of this rank's heads in a (num_heads * width)-row projection."""
        per = num_heads // self.world_size
        return torch.arange(self.rank * per * width, (self.rank + 1) * per * width)

    def _shard_latent_attention(self, attn: LatentAttention, cfg: ModelConfig) -> None:
        nh = cfg.num_heads
        q_rows = self._heads(nh, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        if isinstance(attn.q_proj, nn.Linear):
            attn.q_proj = _linear(attn.q_proj.weight.data[q_rows], None)
        else:
            attn.q_b_proj = _linear(attn.q_b_proj.weight.data[q_rows], None)
        per = nh // self.world_size
        attn.kv_b_proj = attn.kv_b_proj.for_heads(self.rank * per, per)
        bias = attn.o_proj.bias
        attn.o_proj = _linear(attn.o_proj.weight.data[:, self._heads(nh, cfg.v_head_dim)],
                              bias.data.clone() if bias is not None and self.rank == 0 else None)
        attn.num_heads = nh // self.world_size

    def _shard_attention(self, attn: Attention, cfg: ModelConfig) -> None:
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        heads_per_rank = nh // self.world_size
        q_rows = torch.arange(self.rank * heads_per_rank * hd, (self.rank + 1) * heads_per_rank
                              * hd)
        kv_rows = torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in self.kv_heads(cfg)])
        rows = torch.cat([q_rows, nh * hd + kv_rows, (nh + nkv) * hd + kv_rows])
        qkv = attn.qkv_proj
        attn.qkv_proj = _linear(qkv.weight.data.index_select(0, rows),
                                None if qkv.bias is None else qkv.bias.data.index_select(0, rows))
        # (the ranks' partial outputs are summed: the bias is added once, by rank 0)
        bias = attn.o_proj.bias
        attn.o_proj = _linear(attn.o_proj.weight.data[:, q_rows],
                              bias.data.clone() if bias is not None and self.rank == 0 else None)
        if attn.sinks is not None:
            per = heads_per_rank
            attn.sinks = _param(attn.sinks.data[self.rank * per : (self.rank + 1) * per].clone())
        if cfg.qk_norm_whole:  # each rank normalizes its slice by the whole projection's norm
            attn.q_norm.weight = _param(attn.q_norm.weight.data[q_rows])
            attn.k_norm.weight = _param(attn.k_norm.weight.data[kv_rows])
        attn.num_heads, attn.num_kv_heads = heads_per_rank, len(self.kv_heads(cfg))

    def _shard_mlp(self, mlp: MLP) -> None:
        mlp.gate_proj = _linear(self._part(mlp.gate_proj.weight.data, 0), None)
        mlp.up_proj = _linear(self._part(mlp.up_proj.weight.data, 0), None)
        mlp.down_proj = _linear(self._part(mlp.down_proj.weight.data, 1), None)

    def shard_vocab(self, model: CausalLM) -> None:
        """Embedding and lm_head rows [vocab_start, vocab_start + rows), zero-padded."""
        vocab = model.config.vocab_size
        rows = -(-vocab // self.world_size)
        start = min(self.rank * rows, vocab)
        model.vocab_start, model.vocab_rows = start, rows

        def part(weight: Tensor) -> Tensor:
            out = weight.new_zeros(rows, weight.shape[1])
            mine = weight[start : start + rows]
            out[: len(mine)] = mine
            return out

        embed = model.model.embed_tokens
        embed.weight = _param(part(embed.weight.data))
        embed.num_embeddings = rows
        if isinstance(model.lm_head, nn.Linear) and model.lm_head.weight.numel():
            model.lm_head = _linear(part(model.lm_head.weight.data), None)


def _param(t: Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    linear.weight = _param(weight)
    if bias is not None:
        linear.bias = _param(bias)
    return linear
