"""The sliding-window layers' own blocks (a hybrid model's second block table, as vLLM's hybrid
KV cache manager keeps one per attention type): GPT-OSS alternates full-attention layers with
layers that read only the last `window` tokens, so those layers' K/V past the window is never
read again. They keep it in a pool of their own, and a sequence's `window_table` holds a block
only for what a query can still read: from the first block a query at the next position reads
(keys from position - window + 1 on) to its last token. Blocks that fall behind are given back
as the sequence grows, so the sliding layers hold about `window` tokens a sequence however long
it runs, and the full layers' pool (core/block_manager.py, which drives this one) gets the
memory they no longer take.

Prefix caching works per pool: a block of the sliding layers is registered under the same
chained hash as the full layers' block of those tokens, and stays cached (evictable) once given
back. A prefix hit of h blocks is usable only where the sliding layers' blocks a query at
position h * block_size reads are cached too (`usable_hits`: the longest such h); their K/V is
what the next tokens' sliding layers need. This pool publishes no KV events: the KV index
tracks the full layers' blocks.
"""

from __future__ import annotations

from evenflow.engine.core.block_manager import BlockManager
from evenflow.engine.core.sequence import Sequence

NO_BLOCK = -1  # a window_table entry behind the window (or never needed)


class WindowBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int, window: int, salt: bytes = b"",
                 enable_prefix_caching: bool = True) -> None:
        super().__init__(num_blocks, block_size, salt, enable_prefix_caching)
        assert window > 0
        self.window = window
        self.records_events = False

    def first_needed(self, start: int) -> int:
        """The first block a query at position `start` (or later) reads."""
        return max(0, start - self.window + 1) // self.block_size

    def usable_hits(self, seq: Sequence, hits: list[int]) -> list[int]:
        """The longest prefix of the full layers' `hits` whose sliding-layer blocks are cached
        here too; those blocks go into seq.window_hits (logical block -> block)."""
        seq.window_hits = {}
        for h in range(len(hits), 0, -1):
            if self.cached.get(seq.block_hashes[h - 1]) is None:
                continue
            found = {i: self.cached.get(seq.block_hashes[i])
                     for i in range(self.first_needed(h * self.block_size), h)}
            if all(b is not None for b in found.values()):
                seq.window_hits = found  # type: ignore[assignment]
                return hits[:h]
        return []

    @staticmethod
    def _start(seq: Sequence, hits: list[int], block_size: int) -> int:
        """Where the sequence's first computation starts: after its hits, or after an imported
        prompt (its K/V written in at admission)."""
        return seq.num_prompt_tokens if seq.pending_kv is not None else len(hits) * block_size

    def can_allocate_first(self, seq: Sequence, hits: list[int], num_tokens: int) -> bool:
        first = self.first_needed(self._start(seq, hits, self.block_size))
        found = seq.window_hits if hits else {}
        new = sum(1 for i in range(first, self.blocks_needed(num_tokens)) if i not in found)
        hits_in_free = sum(1 for b in found.values() if b in self.free)
        return self.num_free_blocks - hits_in_free >= new

    def allocate_first(self, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        assert not seq.window_table
        first = self.first_needed(self._start(seq, hits, self.block_size))
        found = seq.window_hits if hits else {}
        seq.window_hits = {}
        seq.window_table = [NO_BLOCK] * self.blocks_needed(num_tokens)
        for i, block in found.items():  # (claimed before any fresh block is taken)
            self.free.pop(block, None)
            self.ref_counts[block] += 1
            seq.window_table[i] = block
        for i in range(first, len(seq.window_table)):
            if seq.window_table[i] == NO_BLOCK:
                seq.window_table[i] = self._take_free()
        seq.window_released = first

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        table, first = seq.window_table, self.first_needed(seq.num_computed_tokens)
        released = sum(1 for b in table[seq.window_released:first]
                       if b != NO_BLOCK and self.ref_counts[b] == 1)
        new = sum(1 for i in range(first, self.blocks_needed(num_tokens))
                  if i >= len(table) or table[i] == NO_BLOCK)
        return new <= self.num_free_blocks + released

    def append_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks behind the window of the chunk about to run (it starts at
        seq.num_computed_tokens), and hold blocks up to `num_tokens` tokens."""
        table, first = seq.window_table, self.first_needed(seq.num_computed_tokens)
        for i in range(seq.window_released, min(first, len(table))):
            if table[i] != NO_BLOCK:
                self._release(table[i])
                table[i] = NO_BLOCK
        seq.window_released = max(seq.window_released, first)
        table.extend([NO_BLOCK] * (self.blocks_needed(num_tokens) - len(table)))
        for i in range(first, len(table)):
            if table[i] == NO_BLOCK:
                table[i] = self._take_free()

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the held blocks that became full and computed (seq.block_hashes is
        current: the full layers' manager extended it)."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for i in range(seq.window_released, full):
            block, h = seq.window_table[i], seq.block_hashes[i]
            if block != NO_BLOCK and self.block_hash[block] is None and h not in self.cached:
                self.block_hash[block], self.cached[h] = h, block

    def free_sequence(self, seq: Sequence) -> None:
        for block in reversed(seq.window_table):
            if block != NO_BLOCK:
                self._release(block)
        seq.window_table.clear()
        seq.window_released = 0

    def _take_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        self._evict(block)
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0
        if self.ref_counts[block] == 0:
            self.free[block] = None
