"""The model runner: owns the model and its paged KV cache, turns a step's scheduled chunks into
flat input tensors and attention metadata, runs the forward pass and samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from evenflow.engine.config.settings import switched_on
from evenflow.engine.core.scheduler import ScheduledChunk
from evenflow.engine.kernels import native
from evenflow.engine.model.attention import Attention, AttentionKernels, paged_decode_attention
from evenflow.engine.model.decode_stack import fast_stack
from evenflow.engine.model.kv_spec import KVCacheSpec, SlidingLayers
from evenflow.engine.model.metadata import AttentionMetadata, PrefillSegment
from evenflow.engine.model.mla import LatentAttention
from evenflow.engine.model.moe import MoE
from evenflow.engine.model.norm import RMSNorm
from evenflow.engine.model.placement import SlotPlacement
from evenflow.engine.model.transformer import CausalLM
from evenflow.engine.sample.guided import Guides
from evenflow.engine.sample.logits_processing import record_prompt_logprobs
from evenflow.engine.sample.sampler import sample


@dataclass(frozen=True)
class ChunkInput:
    """What the forward pass needs of one scheduled chunk: plain values, so that a
    tensor-parallel leader can send a step to its followers (engine/runners/tp.py)."""

    token_ids: list[int]  # the chunk's new tokens
    start: int  # tokens of its sequence already in the cache
    block_table: list[int]
    samples: bool
    every_row: bool = False  # logits for every token of the chunk (prompt logprobs)
    # the sliding-window layers' blocks (-1: given back), where they have a pool of their own
    window_table: list[int] | None = None
    drafts: int = 0  # its last tokens are a draft to verify: every row's logits, unsampled
    adapter: str = ""  # its LoRA adapter's name (model/lora.py; "": the base model)

    @classmethod
    def of(cls, chunk: ScheduledChunk) -> ChunkInput:
        seq, start = chunk.seq, chunk.seq.num_computed_tokens
        every_row = bool(chunk.draft) or (
            seq.params.prompt_logprobs is not None and chunk.num_tokens > 1
            and start < seq.num_prompt_tokens - 1)
        own = chunk.num_tokens - len(chunk.draft)
        return cls(seq.token_ids[start : start + own] + list(chunk.draft), start,
                   seq.block_table, chunk.samples, every_row, seq.window_table or None,
                   len(chunk.draft), seq.params.lora_name)

    @property
    def logit_rows(self) -> int:
        return len(self.token_ids) if self.every_row else int(self.samples)


def one_token_rows(chunks: list[ChunkInput]) -> list[ChunkInput]:
    """Deterministic mode: each chunk's tokens as one-token chunks, each attending to its own
    prefix as a decoded token does (the step writes every row's K/V before any row attends),
    with the same logit rows in the same order. A position's K/V and logits then come from the
    same kernels with the same reduction order whether it was prefilled, chunk-prefilled,
    decoded or re-prefilled after a migration: the row kernels compute each row on its own."""
    if all(len(c.token_ids) == 1 for c in chunks):
        return chunks
    rows: list[ChunkInput] = []
    for c in chunks:
        last = len(c.token_ids) - 1
        rows.extend(ChunkInput([t], c.start + i, c.block_table,
                               c.every_row or (i == last and c.samples), False, c.window_table,
                               adapter=c.adapter)
                    for i, t in enumerate(c.token_ids))
    return rows


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, max_model_len: int,
                 dtype: torch.dtype, kv_cache_dtype: str = "auto", window_blocks: int = 0
                 ) -> None:
        """`window_blocks` > 0: the sliding-window layers' pool of their own (model/kv_spec.py
        SlidingLayers), that many blocks; 0: every layer reads the one block table."""
        cfg = model.config
        self.model, self.block_size, self.dtype = model, block_size, dtype
        self.eos_token_ids: frozenset[int] = frozenset(model.config.eos_token_ids)  # min_tokens
        self.guides: Guides | None = None  # the engine's grammar matchers (structured output)
        # Per layer a (K, V) pair, (num_slots + 1, n_kv, hd) each, or MLA's one latent
        # (num_slots + 1, 1, kv_lora_rank + rope), of this rank's KV heads (all of them without
        # TP); int8 (kv_cache_dtype="int8"): the parts, then their scales (engine/model/
        # kv_spec.py). The last slot is the null slot padded positions read.
        self.kv_spec = KVCacheSpec.of(cfg, block_size, dtype, kv_cache_dtype, model.num_kv_heads)
        self.sliding = SlidingLayers.of(cfg, max_model_len) if window_blocks else None
        assert self.sliding is not None or not window_blocks, "no sliding layers to pool"
        self.kv_caches: list[tuple[Tensor, ...]] = self.kv_spec.allocate(
            num_blocks, self.sliding, window_blocks)
        self.null_slot = num_blocks * block_size
        # the sliding pool's zeroed block (window tables' given-back entries read it)
        self.window_null_block = window_blocks
        self.attention_shape = (cfg.head_dim, cfg.num_heads // cfg.num_kv_heads)
        # the paged decode kernel serves grouped-query attention, with sinks and windows; MLA
        # has a kernel of its own (kernels/mla_decode.cpp: the GQA kernel's loop, its latent as
        # K and V, ran 0.94x / 0.83x torch's SDPA at batch 1 / 8)
        self.paged_attention_usable = not cfg.mla
        self.mla_latent = (cfg.kv_lora_rank, cfg.qk_rope_head_dim) if cfg.mla else None
        self.forward_calls = 0  # expert-parallel ranks check that each step ran one
        # Deterministic mode (EngineConfig.deterministic): every prompt token is computed as a
        # decoded token is, so its K/V and logits do not depend on how it was scheduled
        self.deterministic = False
        self.max_model_len = max_model_len
        # with model.keep_hidden: the last forward's final hidden states, one tensor per chunk
        # (its rows in token order), for speculative decoding's next-token layer
        self.chunk_hidden: list[Tensor] = []
        self.attach(model)

    def choose_kernels(self, model: CausalLM) -> None:
        """Each layer's native kernels, chosen once for this dtype and cache (a forward then
        asks nothing of native.*): GQA layers' rotary write, prefill, paged decode and int8
        cache (AttentionKernels), MLA layers' absorbed decode and expanded prefill, the norms,
        MoE routing."""
        cache_dtype = self.kv_spec.dtype
        norms, route_topk = native.norms(), native.route_topk()
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.kernels = norms
            elif isinstance(module, MoE):
                module.route_kernel = route_topk
            if isinstance(module, Attention):
                module.kernels = AttentionKernels.choose(module, self.dtype, cache_dtype)
            elif isinstance(module, LatentAttention):
                module.decode_kernels = native.mla_decode()
                # (one "KV head" per query head: the expanded form's K and V, any cache dtype)
                module.prefill_kernel = native.prefill_attention() if \
                    native.prefill_attention_serves(self.dtype, module.nope + module.rope, 1) \
                    else None
                module.kv_int8_kernels = native.kv_int8() if cache_dtype == torch.int8 else None

    def attach(self, model: CausalLM) -> None:
        """Run `model` over this runner's KV cache: at construction, and when the engine
        reloads its weights onto kernels built since (the cache's blocks stay valid)."""
        cfg = model.config
        self.model = model
        for module in model.modules():
            # a window no sequence here can outgrow is full attention (exactly): such layers
            # keep the fast decode stack, which serves no windows
            if isinstance(module, Attention) and module.window >= self.max_model_len:
                module.window = 0
        model.init_rope(self.max_model_len, self.dtype)
        self.choose_kernels(model)
        if switched_on("EVENFLOW_FAST_DECODE"):
            model.decode_stack_builder = fast_stack
        moe = model.moe_layers()
        # Tokens routed to each (MoE layer, expert), accumulated until the caller resets it.
        self.expert_counts = torch.zeros(len(moe), max(cfg.num_experts, 1), dtype=torch.int64)
        for row, layer in enumerate(moe):
            layer.counts = self.expert_counts[row]

    def _paged_decode(self, batch: int) -> bool:
        """Whether this step's decode attention reads the cache in place (a native kernel:
        decode_lens, no padding mask) or runs torch's gathered attention (decode_mask)."""
        if self.mla_latent is not None:
            return native.mla_decode_serves(*self.mla_latent)
        return self.paged_attention_usable and self.kv_spec.kernels_serve() and \
            (self.deterministic or paged_decode_attention(batch, *self.attention_shape))

    @property
    def quantized_kv(self) -> bool:
        return self.kv_spec.quantized

    def _blocks_view(self, cache: Tensor) -> Tensor:
        """(num_blocks, block_size, n_kv, hd) view of one layer's K or V cache (its pool's:
        every cache has one null slot past its blocks)."""
        return cache[: cache.shape[0] - 1].view(-1, self.block_size, *cache.shape[1:])

    def _layer_indexes(self, block_ids: list[int], window_ids: list[int] | None
                       ) -> list[tuple[Tensor, Tensor | None]]:
        """Per layer, the blocks to read or write as an index into its pool, and for a
        sliding layer which of them it holds (None: all): `window_ids` are the same blocks in
        the sliding layers' table (-1, or None altogether: not held there; read as zeros from
        its null block, not written)."""
        full = torch.tensor(block_ids, dtype=torch.long)
        if self.sliding is None:
            return [(full, None)] * len(self.kv_caches)
        ids = torch.tensor(window_ids if window_ids is not None else [-1] * len(block_ids),
                           dtype=torch.long)
        held = ids >= 0
        window = torch.where(held, ids, self.window_null_block)
        return [(window, held) if layer in self.sliding.layers else (full, None)
                for layer in range(len(self.kv_caches))]

    def _flat_caches(self) -> list[Tensor]:
        return [cache for pair in self.kv_caches for cache in pair]

    def _kv_kernels(self) -> object | None:
        """kernels/kv_blocks.cpp, which copies (K, V) pairs only (MLA's latent and the int8
        cache's scaled blocks: torch)."""
        return native.kv_blocks() if len(self.kv_caches[0]) == 2 else None

    def read_kv(self, block_ids: list[int], window_ids: list[int] | None = None) -> Tensor:
        """A contiguous copy of the blocks' cache, block-major so that any run of blocks is one
        contiguous byte range: (blocks, layers, parts, block_size, heads, dims); parts are
        K and V (2, n_kv, hd), or MLA's latent (1, 1, kv_lora_rank + rope). An int8 cache's
        block is (layers, parts, bytes) int8: each part's values, then its float32 scales
        (proto/kv_handoff.py). With a sliding-window pool, `window_ids` are the same blocks in
        its table (_layer_indexes): a sliding layer's blocks it gave back read as zeros."""
        indexes = self._layer_indexes(block_ids, window_ids)
        if self.quantized_kv:
            n = self.kv_spec.num_parts
            return torch.stack([torch.stack([torch.cat([
                self._blocks_view(parts[j]).index_select(0, index).flatten(1),
                parts[n + j].index_select(0, index).view(torch.int8)], dim=1)
                for j in range(n)], dim=1)
                for parts, (index, _) in zip(self.kv_caches, indexes, strict=True)], dim=1)
        kernels = self._kv_kernels()
        if kernels is not None and self.sliding is None:  # one memcpy per (block, layer, part)
            return kernels.kv_blocks_read(  # type: ignore[attr-defined]
                self._flat_caches(), indexes[0][0], self.block_size)
        return torch.stack([torch.stack([self._blocks_view(part).index_select(0, index)
                                         for part in parts], dim=1)
                            for parts, (index, _) in zip(self.kv_caches, indexes, strict=True)],
                           dim=1)

    def write_kv(self, block_ids: list[int], kv: Tensor, window_ids: list[int] | None = None
                 ) -> None:
        """Inverse of read_kv: kv (blocks, layers, parts, block_size, heads, dims) into these
        blocks (a sliding layer's only into the blocks its table holds)."""
        indexes = self._layer_indexes(block_ids, window_ids)
        if self.quantized_kv:
            block_shape = self._blocks_view(self.kv_caches[0][0]).shape[1:]
            values = block_shape.numel()
            n = self.kv_spec.num_parts
            for layer, parts in enumerate(self.kv_caches):
                index, rows = self._held(indexes[layer], kv.shape[0])
                for j in range(n):
                    raw = kv[rows, layer, j]  # (blocks, values + 4 * heads)
                    self._blocks_view(parts[j]).index_copy_(
                        0, index, raw[:, :values].reshape(-1, *block_shape))
                    parts[n + j].index_copy_(0, index, raw[:, values:].contiguous().view(
                        torch.float32))
            return
        kernels = self._kv_kernels()
        if kernels is not None and kv.is_contiguous() and self.sliding is None and \
                kv.dtype == self.kv_caches[0][0].dtype:
            kernels.kv_blocks_write(  # type: ignore[attr-defined]
                self._flat_caches(), indexes[0][0], kv, self.block_size)
            return
        for layer, parts in enumerate(self.kv_caches):
            index, rows = self._held(indexes[layer], kv.shape[0])
            for j, part in enumerate(parts):
                self._blocks_view(part).index_copy_(0, index,
                                                    kv[rows, layer, j].to(part.dtype))

    @staticmethod
    def _held(layer_index: tuple[Tensor, Tensor | None], blocks: int) -> tuple[Tensor, Tensor]:
        """A layer's blocks to write, and which rows of the payload go there."""
        index, held = layer_index
        if held is None:
            return index, torch.arange(blocks)
        return index[held], held.nonzero().flatten()

    def kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        return self.kv_spec.transfer_shape(num_blocks)

    def _slots(self, block_table: list[int], start: int, end: int) -> Tensor:
        positions = torch.arange(start, end)
        table = torch.tensor(block_table)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def prepare(self, chunks: list[ChunkInput], decode_seqs: int = 0
                ) -> tuple[Tensor, Tensor, AttentionMetadata, Tensor]:
        """Prefill chunks come first, then the decodes (one token each). With a sliding-window
        pool, its layers get metadata of their own over the window tables (`meta.sliding`).
        `decode_seqs`: the sequences the decode rows belong to, where a draft's tokens run as
        rows of their own (the decode attention is chosen by it, as the step without the
        drafts would choose)."""
        input_ids: list[int] = []
        position_parts: list[Tensor] = []
        logit_rows: list[int] = []
        decodes = [c for c in chunks if len(c.token_ids) == 1]
        for c in chunks[: len(chunks) - len(decodes)]:
            start, q_start = c.start, len(input_ids)
            input_ids.extend(c.token_ids)
            position_parts.append(torch.arange(start, start + len(c.token_ids)))
            if c.every_row:
                logit_rows.extend(range(q_start, len(input_ids)))
            elif c.samples:
                logit_rows.append(len(input_ids) - 1)
        num_prefill = len(input_ids)
        if decodes:
            input_ids.extend(c.token_ids[0] for c in decodes)
            position_parts.append(torch.tensor([c.start for c in decodes]))
            logit_rows.extend(num_prefill + j for j, c in enumerate(decodes) if c.samples)
        meta = self._metadata(chunks, [c.block_table for c in chunks], self.null_slot,
                              decode_seqs)
        if self.sliding is not None:
            null = self.window_null_block
            # (a chunk made by hand, with no window table, names the same blocks in both)
            tables = [[b if b >= 0 else null for b in c.window_table or c.block_table]
                      for c in chunks]
            meta.sliding = self._metadata(chunks, tables, (null + 1) * self.block_size,
                                          decode_seqs)
        positions = position_parts[0] if len(position_parts) == 1 else torch.cat(position_parts)
        return (torch.tensor(input_ids), positions, meta,
                torch.tensor(logit_rows, dtype=torch.long))

    def _metadata(self, chunks: list[ChunkInput], tables: list[list[int]], null_slot: int,
                  decode_seqs: int = 0) -> AttentionMetadata:
        """Attention's view of the step over one pool: each chunk's block table (`tables`, in
        chunk order) and the pool's null slot."""
        slot_parts: list[Tensor] = []
        prefills: list[PrefillSegment] = []
        q_start = 0
        num_decodes = sum(1 for c in chunks if len(c.token_ids) == 1)
        for c, table in zip(chunks[: len(chunks) - num_decodes], tables, strict=False):
            start, end = c.start, c.start + len(c.token_ids)
            ctx_slots = self._slots(table, 0, end)
            slot_parts.append(ctx_slots[start:])
            prefills.append(PrefillSegment(q_start, len(c.token_ids), end,
                                           ctx_slots if start else None))
            q_start += len(c.token_ids)
        decode_slots = decode_mask = decode_lens = None
        if num_decodes:
            bs = self.block_size
            decodes = chunks[len(chunks) - num_decodes :]
            decode_tables = tables[len(chunks) - num_decodes :]
            lens = [c.start + 1 for c in decodes]
            width = max(len(t) for t in decode_tables)
            padded = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables])  # (B, n)
            all_slots = (padded.unsqueeze(2) * bs + torch.arange(bs)).view(len(decodes), -1)
            ctx = torch.tensor(lens)  # (B,)
            if self._paged_decode(decode_seqs or len(decodes)):
                # the paged kernel reads each row's first lens slots only: no padding to mask
                decode_slots, decode_lens = all_slots, ctx
            else:
                max_ctx = max(lens)
                real = torch.arange(max_ctx).unsqueeze(0) < ctx.unsqueeze(1)  # (B, L)
                decode_slots = torch.where(real, all_slots[:, :max_ctx], null_slot)
                # Additive mask in the model's dtype, made once per step: torch's CPU attention
                # turns a bool mask into this in every layer (measured 1.3x slower at batch 32)
                decode_mask = torch.zeros(len(decodes), 1, 1, max_ctx, dtype=self.dtype
                                          ).masked_fill_(~real.view(len(decodes), 1, 1, max_ctx),
                                                         float("-inf"))
            slot_parts.append(torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(
                decode_tables, (c.start for c in decodes), strict=True)]))
        return AttentionMetadata(
            slot_mapping=slot_parts[0] if len(slot_parts) == 1 else torch.cat(slot_parts),
            prefills=prefills, num_prefill_tokens=q_start, decode_slots=decode_slots,
            decode_mask=decode_mask, decode_lens=decode_lens)

    def run(self, chunks: list[ScheduledChunk]) -> list[int | Tensor]:
        """Forward the step; return one sampled token per chunk whose `samples` is True (a
        chunk with a draft: its rows' logits instead, for the engine to verify)."""
        inputs = [ChunkInput.of(c) for c in chunks]
        return self.sample_step(chunks, inputs, self.forward(inputs))

    def sample_step(self, chunks: list[ScheduledChunk], inputs: list[ChunkInput],
                    logits: Tensor) -> list[int | Tensor]:
        """Record prompt logprobs from chunks that asked for every row; sample the rest (a
        draft's rows are returned as they are, in the chunk's place)."""
        drafted: dict[int, Tensor] = {}
        if any(i.every_row for i in inputs):
            rows, offset = [], 0
            for j, (chunk, given) in enumerate(zip(chunks, inputs, strict=True)):
                block = logits[offset : offset + given.logit_rows]
                if given.drafts:
                    drafted[j] = block
                elif given.every_row:
                    record_prompt_logprobs(chunk.seq, given, block)
                if given.samples and not given.drafts:
                    rows.append(offset + given.logit_rows - 1)
                offset += given.logit_rows
            logits = logits[rows]
        seqs = [c.seq for j, c in enumerate(chunks) if c.samples and j not in drafted]
        tokens = iter(sample(logits, seqs, self.eos_token_ids, self.guides) if seqs else [])
        return [drafted[j] if j in drafted else next(tokens)
                for j, c in enumerate(chunks) if c.samples]

    @torch.inference_mode()
    def forward(self, chunks: list[ChunkInput]) -> Tensor:
        """(sampled chunks, vocab) float32 logits."""
        self.forward_calls += 1
        lengths = [len(c.token_ids) for c in chunks]
        if self.deterministic:
            chunks = one_token_rows(chunks)
        elif any(c.drafts for c in chunks):
            return self._forward_with_drafts(chunks)
        input_ids, positions, meta, logit_rows = self.prepare(chunks)
        logits = self._model_step(chunks, input_ids, positions, meta, logit_rows)
        if self.model.keep_hidden:
            assert self.model.hidden_rows is not None
            self.chunk_hidden = list(self.model.hidden_rows.split(lengths))
        return logits

    def _model_step(self, chunks: list[ChunkInput], input_ids: Tensor, positions: Tensor,
                    meta: AttentionMetadata, logit_rows: Tensor) -> Tensor:
        """The model over a prepared step; rows of LoRA requests with their adapters'
        deltas (model/lora.py: the rows in the chunks' order, as prepare lays them out)."""
        adapters = self.model.adapters
        if adapters is None or not any(c.adapter for c in chunks):
            return self.model(input_ids, positions, self.kv_caches, meta, logit_rows)
        adapters.begin_step([c.adapter for c in chunks for _ in c.token_ids])
        try:
            return self.model(input_ids, positions, self.kv_caches, meta, logit_rows)
        finally:
            adapters.end_step()

    def _forward_with_drafts(self, chunks: list[ChunkInput]) -> Tensor:
        """A draft's tokens run as decoded tokens do (one_token_rows: each row attends to its
        own prefix through the decode kernels), so each verified position's logits come from
        the kernels decoding it would have used; the step's logits come back in chunk order."""
        prefill = [len(c.token_ids) > 1 and not c.drafts for c in chunks]
        prefills = [i for i, is_prefill in enumerate(prefill) if is_prefill]
        rows = [i for i, is_prefill in enumerate(prefill) if not is_prefill]
        order = [chunks[i] for i in prefills] + one_token_rows([chunks[i] for i in rows])
        input_ids, positions, meta, logit_rows = self.prepare(order, decode_seqs=len(rows))
        logits = self._model_step(order, input_ids, positions, meta, logit_rows)
        # the logits in prefills + rows order, each chunk's run back to its own place
        runs = dict(zip(prefills + rows, logits.split(
            [chunks[i].logit_rows for i in prefills + rows]), strict=True))
        if self.model.keep_hidden:
            assert self.model.hidden_rows is not None
            hidden = dict(zip(prefills + rows, self.model.hidden_rows.split(
                [len(chunks[i].token_ids) for i in prefills + rows]), strict=True))
            self.chunk_hidden = [hidden[i] for i in range(len(chunks))]
        return torch.cat([runs[i] for i in range(len(chunks))])

    def forward_dummy(self) -> None:
        """One token into the spare (null) slot, nothing sampled: a pass whose only use is to
        meet the other expert-parallel ranks' collectives. The slot is read only where masked."""
        window = [self.window_null_block] if self.sliding is not None else None
        self.forward([ChunkInput([0], 0, [self.null_slot // self.block_size], False, False,
                                 window)])

    def apply_placement(self, phy2log: Tensor, share: Tensor | None, num_ep_ranks: int) -> None:
        """Every MoE layer under a new expert placement: phy2log (moe_layers, slots), share
        (moe_layers, slots) or None for even replica shares."""
        for row in range(len(self.model.moe_layers())):
            self.apply_layer_placement(row, phy2log[row], None if share is None else share[row],
                                       num_ep_ranks)

    def apply_layer_placement(self, row: int, phy2log: Tensor, share: Tensor | None,
                              num_ep_ranks: int) -> int:
        """MoE layer `row` (of moe_layers()) under its new placement (slots,); how many
        experts it had to read."""
        layer = self.model.moe_layers()[row]
        # expert-parallel across hosts: this host's rows go to its own replicas where it has one
        local_ranks = getattr(layer.ep, "local_ranks", None)
        return layer.set_placement(SlotPlacement.build(
            phy2log, self.model.config.num_experts, num_ep_ranks, share, local_ranks))
