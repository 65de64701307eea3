"""A step's batch as attention sees it: the flat batch holds the prefill segments' tokens
first, then one token per decoding sequence; where each new token's K/V goes in the paged cache
(slot = block_id * block_size + offset) and what each query attends to."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


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
    # The runner picks the decode attention once per step (paged_decode_attention) and fills
    # the one input it reads: lens for the paged kernel, the additive mask for torch's path.
    decode_mask: Tensor | None  # (B_dec, 1, 1, L) 0 where a slot is real, -inf else (None: paged)
    decode_lens: Tensor | None = None  # (B_dec,) int64: how many of decode_slots are real
    # sliding-window layers' views of decode_slots / decode_lens, by window (model/attention.py)
    windows: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    # the sliding-window layers' view where they keep a pool of their own (the same batch over
    # their window tables: engine/core/window_blocks.py)
    sliding: AttentionMetadata | None = None
