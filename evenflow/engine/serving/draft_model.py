"""Drafting with a model (speculative decoding's `draft_model` and `mtp` methods): the drafter
keeps, for each target sequence it drafts for, a shadow sequence in a KV cache of its own, runs
it greedily for k tokens a step, all drafting sequences batched in each of the k forward passes,
and rolls the shadow back to what the target kept before the next step.

- `draft_model`: a smaller model with the target's tokenizer. Its shadow holds the target's
  tokens; the first draft pass computes the ones it has not seen (the prompt, at a sequence's
  first draft), and its last row gives the first draft token.
- `mtp`: the checkpoint's next-token layer (engine/model/next_token.py). Its row for position p
  takes the target's hidden state at p and the token at p + 1, so its shadow is the target's
  tokens shifted by one, fed with the hidden states the target's steps produced
  (`take_hidden`, after each step, for the positions the target kept). A sequence whose
  earlier hidden states this worker never saw (its prompt prefilled elsewhere, P/D) starts its
  shadow where they begin: rotary attention depends on relative positions only, so a shadow
  counted from there attends exactly as one counted from 0 would over the same rows.

Greedy drafts are fixed guesses, so the engine's verification (engine/serving/speculation.py)
keeps the target's output and distribution whatever the draft. Shadows follow their targets'
ends (`release`), and a shadow that cannot get blocks only costs its sequence its draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import orjson
import torch
from torch import Tensor

from evenflow.engine.config.settings import EngineConfig, ModelLoadError
from evenflow.engine.core.block_manager import BlockManager
from evenflow.engine.core.sequence import Sequence
from evenflow.engine.model.next_token import NextTokenModel
from evenflow.engine.model.transformer import CausalLM
from evenflow.engine.runners.model_runner import ChunkInput, ModelRunner
from evenflow.engine.spec.config import MAX_SPECULATIVE_TOKENS
from evenflow.engine.weights.loader import load_weights, model_directory, quant_config
from evenflow.engine.weights.next_token import load_next_token_model
from evenflow.engine.weights.prepack import prepack_model
from evenflow.proto.sampling import SamplingParams

# mtp under P/D: the prompt positions whose hidden states travel with the K/V (the decode
# side's next-token layer attends over these; a row is hidden_size values: 14 KB each for
# DeepSeek-V3 in bf16, 3.5 MB for all 256, against ~70 KB of K/V per position)
HANDED_POSITIONS = 256


@dataclass
class Shadow:
    """A target sequence's copy in the drafter's cache. `seq.token_ids` are the draft model's
    inputs: shadow index j is target position origin + j (mtp: its input is the token at
    origin + j + 1, with the target's hidden state at origin + j in `hidden`)."""

    target: Sequence
    seq: Sequence
    origin: int = 0
    hidden: list[Tensor] = field(default_factory=list)  # mtp: rows not yet in the cache
    valid: int = 0  # mtp: rows in the cache computed from the target's hidden states
    fed: bool = False  # mtp: this pass's rows take the target's hidden states


class ModelDrafter:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, max_model_len: int,
                 dtype: torch.dtype, vocab_size: int) -> None:
        self.runner = ModelRunner(model, num_blocks, block_size, max_model_len, dtype)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.vocab_size = vocab_size  # draft tokens the target can take
        self.shadows: dict[int, Shadow] = {}  # by id() of the target sequence
        self._own: dict[int, Tensor] = {}  # mtp: each shadow's last output hidden state

    # -- what each method makes of the target's state -------------------------------------
    def _sync(self, shadow: Shadow) -> bool:
        """Bring the shadow's inputs up to the target's tokens, rolling back what the target
        did not keep; False when it cannot draft now."""
        target, seq = shadow.target, shadow.seq
        tokens = target.token_ids
        # (only the last step's drafts can differ from the target's tokens)
        kept = _common_prefix(seq.token_ids, tokens, seq.num_computed_tokens,
                              MAX_SPECULATIVE_TOKENS + 1)
        seq.num_computed_tokens = min(seq.num_computed_tokens, kept)
        del seq.token_ids[kept:]
        seq.token_ids.extend(tokens[kept:])
        return True

    def _pass_inputs(self, shadows: list[Shadow], inputs: list[ChunkInput]) -> None:
        """Set what a pass needs beside its tokens (mtp: the hidden states)."""

    def _after_pass(self, shadows: list[Shadow], drafted: list[int]) -> None:
        """A pass's rows are in the cache and each shadow drafted one more token."""

    # -- drafting --------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, asks: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Greedy drafts of the asked lengths, in order ([] where k is 0 or it cannot)."""
        self._drop_finished()
        drafts: list[list[int]] = [[] for _ in asks]
        active: list[tuple[int, Shadow, int]] = []
        for i, (target, k) in enumerate(asks):
            if k <= 0:
                continue
            shadow = self._shadow(target)
            if not self._sync(shadow) or \
                    len(shadow.seq.token_ids) <= shadow.seq.num_computed_tokens:
                continue
            if self._reserve(shadow.seq, len(shadow.seq.token_ids) + k - 1):
                active.append((i, shadow, k))
        while active:
            # prefill-like chunks first, one-token rows after: the runner's batch layout
            active.sort(key=lambda a: len(a[1].seq.token_ids) - a[1].seq.num_computed_tokens == 1)
            inputs = [ChunkInput(s.seq.token_ids[s.seq.num_computed_tokens:],
                                 s.seq.num_computed_tokens, s.seq.block_table, True)
                      for _, s, _ in active]
            shadows = [s for _, s, _ in active]
            self._pass_inputs(shadows, inputs)
            logits = self.runner.forward(inputs)
            tokens = logits[:, : self.vocab_size].argmax(dim=-1).tolist()
            for (i, s, _), token in zip(active, tokens, strict=True):
                s.seq.num_computed_tokens = len(s.seq.token_ids)
                s.seq.token_ids.append(token)
                drafts[i].append(token)
            self._after_pass(shadows, tokens)
            active = [a for a in active if len(drafts[a[0]]) < a[2]]
        return drafts

    def release(self, target: Sequence) -> None:
        shadow = self.shadows.pop(id(target), None)
        if shadow is not None:
            self.blocks.free_sequence(shadow.seq)

    def _shadow(self, target: Sequence, origin: int = 0) -> Shadow:
        shadow = self.shadows.get(id(target))  # (a shadow keeps its target: no id is reused)
        if shadow is None:
            shadow = self.shadows[id(target)] = Shadow(target, Sequence(
                target.request_id, [], 0, SamplingParams(max_tokens=1)), origin)
        return shadow

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        if not seq.block_table:
            if not self.blocks.can_allocate_first(seq, [], num_tokens):
                return False
            computed = seq.num_computed_tokens
            self.blocks.allocate_first(seq, [], num_tokens)
            seq.num_computed_tokens = computed
            return True
        if not self.blocks.can_append(seq, num_tokens):
            return False
        self.blocks.append_slots(seq, num_tokens)
        return True

    def _drop_finished(self) -> None:
        for shadow in [s for s in self.shadows.values() if s.target.is_finished]:
            self.release(shadow.target)


class DraftModel(ModelDrafter):
    """vLLM's draft_model: a smaller model with the target's tokenizer."""

    @classmethod
    def load(cls, config: EngineConfig, draft: str, target: CausalLM, dtype: torch.dtype,
             num_blocks: int, max_model_len: int) -> DraftModel:
        draft_dir = model_directory(draft)
        target_dir = model_directory(config.model)
        _check_same_tokenizer(draft_dir, target_dir)
        model = load_weights(draft_dir, dtype, replace(
            config, model=str(draft_dir), tensor_parallel_size=1, speculative_config=None,
            show_progress=False))
        return cls(model, num_blocks, config.block_size,
                   min(max_model_len, model.config.max_position_embeddings), dtype,
                   min(model.config.vocab_size, target.config.vocab_size))


class NextTokenDrafter(ModelDrafter):
    """mtp: the checkpoint's own next-token layer, fed the target's hidden states."""

    @classmethod
    def load(cls, config: EngineConfig, target: CausalLM, dtype: torch.dtype, num_blocks: int,
             max_model_len: int) -> NextTokenDrafter:
        model = load_next_token_model(model_directory(config.model), target, dtype,
                                      quant_config(config))
        if config.prepack_weights:
            prepack_model(model, dtype)
        drafter = cls(model, num_blocks, config.block_size, max_model_len, dtype,
                      target.config.vocab_size)
        drafter.runner.model.decode_stack_builder = None  # (its forward is its own)
        return drafter

    @property
    def model(self) -> NextTokenModel:
        model = self.runner.model
        assert isinstance(model, NextTokenModel)
        return model

    def take_hidden(self, target: Sequence, start: int, hidden: Tensor) -> None:
        """The target's hidden states of positions start, start + 1, ... that it kept (after
        its step), for this sequence's next draft."""
        if not len(hidden):
            return
        shadow = self.shadows.get(id(target))
        if shadow is not None:
            have = shadow.origin + shadow.valid + sum(len(h) for h in shadow.hidden)
            if start > have:  # a gap (rows this worker never computed): start afresh
                self.release(target)
                shadow = None
            elif start < have:  # (recomputed after a preemption: the shadow has them)
                hidden = hidden[have - start :]
        if shadow is None:
            shadow = self._shadow(target, origin=start)
        if len(hidden):
            shadow.hidden.append(hidden)
        if target.export_kv:  # (a prompt for another engine: only what the hand-off carries)
            pending = torch.cat(shadow.hidden) if len(shadow.hidden) > 1 else shadow.hidden[0]
            if len(pending) > HANDED_POSITIONS:
                shadow.origin += len(pending) - HANDED_POSITIONS
                pending = pending[-HANDED_POSITIONS:]
            shadow.hidden = [pending]

    def export_hidden(self, target: Sequence) -> Tensor | None:
        """A prompt prefilled for another engine (P/D): the hidden states of its last
        HANDED_POSITIONS positions (what this engine received for it), its shadow let go."""
        shadow = self.shadows.get(id(target))
        if shadow is None or not shadow.hidden:
            return None
        self.release(target)
        rows = torch.cat(shadow.hidden)[-HANDED_POSITIONS:]
        end = shadow.origin + shadow.valid + sum(len(h) for h in shadow.hidden)
        return rows if end == target.num_prompt_tokens else None

    def _sync(self, shadow: Shadow) -> bool:
        """Inputs: the target's tokens at origin + 1, ... for the positions whose hidden states
        are in the cache or waiting; rows past them (last step's drafts) rolled back."""
        seq, tokens = shadow.seq, shadow.target.token_ids
        pending = sum(len(h) for h in shadow.hidden)
        # rows from the target's kept hidden states stay; the drafts' rows are rolled back
        seq.num_computed_tokens = shadow.valid
        del seq.token_ids[seq.num_computed_tokens:]
        end = shadow.origin + seq.num_computed_tokens + pending  # positions with hidden rows
        if end + 1 > len(tokens) or pending == 0:
            return False
        seq.token_ids.extend(tokens[shadow.origin + 1 + seq.num_computed_tokens : end + 1])
        return True

    def _pass_inputs(self, shadows: list[Shadow], inputs: list[ChunkInput]) -> None:
        rows = []
        for shadow in shadows:
            if shadow.hidden:  # the first pass: the target's hidden states
                rows.extend(shadow.hidden)
                shadow.hidden = []
                shadow.fed = True
            else:  # a later one: the layer's own output at the shadow's last row
                rows.append(self._own[id(shadow)])
                shadow.fed = False
        self.model.hidden = torch.cat(rows)
        self.model.first_rows = torch.cat([
            torch.arange(s.origin + i.start, s.origin + i.start + len(i.token_ids)) == 0
            for s, i in zip(shadows, inputs, strict=True)])

    def _after_pass(self, shadows: list[Shadow], drafted: list[int]) -> None:
        out = self.model.out_hidden
        assert out is not None
        self._own = {id(s): out[j : j + 1] for j, s in enumerate(shadows)}
        for shadow in shadows:
            if shadow.fed:  # rows from the target's kept states: they stay in the cache
                shadow.valid = shadow.seq.num_computed_tokens


def _common_prefix(a: list[int], b: list[int], limit: int, tail: int) -> int:
    """The length of a's and b's common prefix (at most `limit`), where they can differ only
    in a's last `tail` tokens."""
    n = min(len(a), len(b), limit)
    for i in range(max(0, len(a) - tail), n):
        if a[i] != b[i]:
            return i
    return n


def _check_same_tokenizer(draft_dir: Path, target_dir: Path) -> None:
    """A draft model must share the target's vocabulary (its token ids are the target's)."""
    vocabs = []
    for d in (draft_dir, target_dir):
        path = d / "tokenizer.json"
        if not path.is_file():
            return  # (nothing to compare: the vocabulary sizes bound the ids)
        vocabs.append(orjson.loads(path.read_bytes()).get("model", {}).get("vocab"))
    if vocabs[0] != vocabs[1]:
        raise ModelLoadError(f"draft model {draft_dir.name} has a tokenizer other than "
                             f"{target_dir.name}'s: speculative draft_model needs the same one")
