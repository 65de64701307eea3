"""Paged KV-cache bookkeeping: fixed-size blocks, per-sequence block tables, reference counts,
prefix caching by chained block hashes, and LRU eviction of free cached blocks.

A full, computed block is registered under its chained hash; when its last user frees it, it
stays cached in the free list (least recently freed first out) until a new allocation evicts it.
Every registration and eviction is recorded as a KV event for the caller to publish.

With a lower tier (the engine's disk tier: engine/runners/disk_tier.py), an evicted cached
block is listed to be saved there before its memory is reused (`take_saves`), and a prefix
that continues past the RAM hits into blocks the lower tier holds is promoted: each such block
gets a free RAM block, registered under its hash at once, listed to be filled
(`take_promotions`) before the step's forward pass. The engine does both copies right after
scheduling. A block evicted earlier in the same schedule, its copy down not made yet, counts as
held below: it is promoted too (filled from that copy), not computed again while the KV index,
told of its eviction and its copy at once, still names it. `tier_counts` counts what the lower
tier served and the prefix lookups it could not serve (the worker exports them as metrics).

A hybrid model's sliding-window layers keep their blocks in a pool of their own
(core/window_blocks.py, `window_pool`): this manager drives it alongside its own table, in every
lookup, allocation, commit and release, so the scheduler and the engine see one manager.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container
from dataclasses import dataclass, field

from evenflow.engine.core.sequence import Sequence
from evenflow.proto.hashing import ROOT_PARENT, adapter_salt, block_hash
from evenflow.proto.messages import BlockRemoved, BlockStored, KVCacheEvent

KVEventListener = Callable[[list[KVCacheEvent]], None]

# Why a prefix lookup stopped at a block the lower tier held: it had dropped the block to make
# room (recently: the index named it until the tier's event reached it), or the block is there
# but no free RAM block is left to promote it into (the request waits for room).
MISS_REASONS = ("evicted", "no_room")
DROPPED_MEMORY = 65536  # dropped hashes remembered for that reason (the latest)


@dataclass
class TierCounts:
    """What the lower tier did since the engine started, in blocks (misses: in lookups, each
    request counted once per reason). Plain ints, bumped on the engine thread; another thread
    may read them (the worker's metrics), a step stale at most."""

    hits: int = 0  # blocks a prefix lookup or a KV pull found there
    promotions: int = 0  # blocks read back into RAM
    writes: int = 0  # blocks written down
    evictions: int = 0  # blocks it dropped to make room
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MISS_REASONS, 0))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, salt: bytes = b"",
                 enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks, self.block_size, self.salt = num_blocks, block_size, salt
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks  # hash a block is cached under
        self.cached: dict[int, int] = {}  # hash -> block id
        # Blocks with no user, oldest first; cached ones among them are evictable prefix hits.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.pending_events: list[KVCacheEvent] = []
        self.records_events = True  # (a sliding-window pool's manager records none)
        # a hybrid model's sliding-window layers' pool, driven alongside (core/window_blocks.py)
        self.window_pool: BlockManager | None = None
        self.lower_tier: Container[int] | None = None  # block hashes held below RAM
        # hash -> block: evicted, to copy down before reuse (its memory holds it until the step)
        self._saves: dict[int, int] = {}
        self._promotions: dict[int, int] = {}  # block -> hash: to fill from the lower tier
        self.tier_counts = TierCounts()
        # hashes the lower tier dropped lately (oldest first), for a miss's reason
        self._dropped_below: OrderedDict[int, None] = OrderedDict()

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def salt_for(self, seq: Sequence) -> bytes:
        """The model's salt, or a LoRA adapter's own (KV never crosses adapters)."""
        name = seq.params.lora_name
        return self.salt if not name else adapter_salt(self.salt, name)

    def update_hashes(self, seq: Sequence) -> None:
        """Extend seq.block_hashes to cover every full block of its tokens."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_PARENT
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            seq.block_hashes.append(block_hash(parent, tokens, self.salt_for(seq)))

    def prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the sequence's leading full blocks. The last token is always
        left to compute, since its logits are needed. With a sliding-window pool, only as many
        as it holds the window's blocks for (WindowBlockManager.usable_hits)."""
        hits = self._own_prefix_hits(seq)
        return self.window_pool.usable_hits(seq, hits) if self.window_pool is not None else hits

    def usable_hits(self, seq: Sequence, hits: list[int]) -> list[int]:
        """How many of another pool's `hits` this pool can serve (a sliding-window pool:
        core/window_blocks.py); a pool of its own: all of them."""
        return hits

    def _own_prefix_hits(self, seq: Sequence) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        self.update_hashes(seq)
        hits: list[int] = []
        chain: set[int] | None = None  # RAM blocks of the prompt's chain, once a promotion asks
        for i, h in enumerate(seq.block_hashes):
            if (i + 1) * self.block_size > seq.num_tokens - 1:
                break
            block = self.cached.get(h)
            below = block is None and self.lower_tier is not None and (
                h in self.lower_tier or h in self._saves)
            if below:
                if chain is None:
                    chain = {b for x in seq.block_hashes if (b := self.cached.get(x)) is not None}
                block = self._promote(seq, i, set(hits), chain)
            if block is None:
                self._note_miss(seq, h, below)
                break
            hits.append(block)
        return hits

    def _note_miss(self, seq: Sequence, h: int, below: bool) -> None:
        """A lookup of seq stopped at block hash h: count why, when the lower tier is the
        reason (once per request and reason)."""
        reason = "no_room" if below else "evicted" if h in self._dropped_below else ""
        if reason and reason != seq.disk_miss:
            self.tier_counts.misses[reason] += 1
        seq.disk_miss = reason

    def note_dropped(self, hashes: list[int]) -> None:
        """The lower tier dropped these blocks to make room."""
        self.tier_counts.evictions += len(hashes)
        for h in hashes:
            self._dropped_below[h] = None
            self._dropped_below.move_to_end(h)
        while len(self._dropped_below) > DROPPED_MEMORY:
            self._dropped_below.popitem(last=False)

    def _promote(self, seq: Sequence, i: int, taken: set[int], chain: set[int]) -> int | None:
        """Block i of seq from the lower tier into a free RAM block (not one of `taken`, and
        one of the prompt's own `chain` only when no other is free), cached under its hash from
        now on; None when no free block is left for it."""
        block = next((b for b in self.free if b not in taken and b not in chain), None)
        if block is None:
            block = next((b for b in self.free if b not in taken), None)
        if block is None:
            return None
        self.tier_counts.hits += 1
        self._evict(block)
        h = seq.block_hashes[i]
        self.block_hash[block], self.cached[h] = h, block
        self.free.move_to_end(block)  # the most recently freed: evicted last
        self._promotions[block] = h
        self._flush_run(seq, [h], i)
        return block

    def cached_run(self, hashes: list[int], first: int) -> list[int]:
        """The RAM blocks cached under hashes[first], hashes[first + 1], ... up to the first
        one not cached."""
        run: list[int] = []
        for h in hashes[first:]:
            block = self.cached.get(h)
            if block is None:
                break
            run.append(block)
        return run

    def insert_cached(self, token_ids: list[int], hashes: list[int], first: int) -> list[int]:
        """Blocks first, first + 1, ... of `token_ids` (hashes: their chained hashes, one per
        full block), brought in from elsewhere: each not cached yet gets a free RAM block,
        registered under its hash as a cached block with no user (the most recently freed:
        evicted last); free blocks holding the first `first` blocks are not taken for them.
        Returns the RAM block of each, in order, -1 where a block was already cached or no
        free block was left (the caller writes K/V only into the others). A KV event tells the
        index."""
        if not self.enable_prefix_caching:
            return [-1] * (len(hashes) - first)
        keep = set(hashes[:first])  # the prefix the caller already holds stays
        spare = iter([b for b in self.free if self.block_hash[b] not in keep])
        placed: list[int] = []
        run: list[int] = []
        run_start = first
        for i in range(first, len(hashes)):
            h = hashes[i]
            block = next(spare, None) if h not in self.cached else None
            if block is None:
                self._flush_tokens(token_ids, hashes, run, run_start)
                run, run_start = [], i + 1
                placed.append(-1)
                continue
            self._evict(block)
            self.block_hash[block], self.cached[h] = h, block
            self.free.move_to_end(block)
            run.append(h)
            placed.append(block)
        self._flush_tokens(token_ids, hashes, run, run_start)
        return placed

    def _flush_tokens(self, token_ids: list[int], hashes: list[int], run: list[int],
                      start: int) -> None:
        if run and self.records_events:
            bs = self.block_size
            self.pending_events.append(BlockStored(
                block_hashes=run, parent_block_hash=hashes[start - 1] if start else None,
                block_size=bs, token_ids=token_ids[start * bs : (start + len(run)) * bs]))

    def take_saves(self) -> list[tuple[int, int]]:
        """(block, hash) of cached blocks evicted since the last call: their memory still holds
        the block until the step runs. Those the lower tier holds already are listed too (it
        counts them as used now)."""
        saves, self._saves = [(b, h) for h, b in self._saves.items()], {}
        return saves

    def take_promotions(self) -> list[tuple[int, int]]:
        """(block, hash) of blocks promoted since the last call, to fill before the step."""
        promotions, self._promotions = list(self._promotions.items()), {}
        return promotions

    # -- allocation -----------------------------------------------------------------------
    def can_allocate_first(self, seq: Sequence, hits: list[int], num_tokens: int) -> bool:
        """Whether `seq` (holding no blocks) can take `hits` and room for `num_tokens` tokens."""
        new_blocks = self.blocks_needed(num_tokens) - len(hits)
        hits_in_free = sum(1 for b in hits if b in self.free)
        return self.num_free_blocks - hits_in_free >= new_blocks and (
            self.window_pool is None or self.window_pool.can_allocate_first(seq, hits, num_tokens))

    def allocate_first(self, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        assert not seq.block_table
        if self.window_pool is not None:
            self.window_pool.allocate_first(seq, hits, num_tokens)
        for block in hits:
            self.free.pop(block, None)
            self.ref_counts[block] += 1
            seq.block_table.append(block)
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_preemptions == 0:  # report what the prompt got from the cache at first sight
            seq.num_cached_tokens = seq.num_computed_tokens
        self._grow(seq, num_tokens)

    def can_append(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= self.num_free_blocks \
            and (self.window_pool is None or self.window_pool.can_append(seq, num_tokens))

    def append_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Grow the block table to hold `num_tokens` tokens in all (and the window's)."""
        self._grow(seq, num_tokens)
        if self.window_pool is not None:
            self.window_pool.append_slots(seq, num_tokens)

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) < self.blocks_needed(num_tokens):
            block, _ = self.free.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full and computed, so later requests can hit them."""
        if not self.enable_prefix_caching:
            return
        self.update_hashes(seq)
        if self.window_pool is not None:
            self.window_pool.commit_full_blocks(seq)
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        run: list[int] = []  # a contiguous run of newly stored blocks
        run_start = 0
        for i in range(full):
            block, h = seq.block_table[i], seq.block_hashes[i]
            # Already registered, or computed twice by concurrent requests (keep the first copy).
            if self.block_hash[block] is not None or h in self.cached:
                self._flush_run(seq, run, run_start)
                run = []
                continue
            self.block_hash[block], self.cached[h] = h, block
            if not run:
                run_start = i
            run.append(h)
        self._flush_run(seq, run, run_start)

    def _flush_run(self, seq: Sequence, run: list[int], start: int) -> None:
        """A BlockStored event (vLLM's schema) for blocks [start, start + len(run))."""
        self._flush_tokens(seq.token_ids, seq.block_hashes, run, start)

    def free_sequence(self, seq: Sequence) -> None:
        """Drop the sequence's references; its tail blocks become the first to be evicted."""
        if self.window_pool is not None:
            self.window_pool.free_sequence(seq)
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0
            if self.ref_counts[block] == 0:
                self.free[block] = None
        seq.block_table.clear()

    def cached_hashes(self) -> list[int]:
        """Every block hash the prefix cache holds (in use or free), for a KV-index resync."""
        return list(self.cached)

    def take_events(self) -> list[KVCacheEvent]:
        events, self.pending_events = self.pending_events, []
        return events

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self._uncache(block)
            if self.records_events:
                self.pending_events.append(BlockRemoved(block_hashes=[h]))
            # never filled: the lower tier still has it (or its copy down is pending); else
            # copy it down before reuse
            if self._promotions.pop(block, None) is None and self.lower_tier is not None:
                self._saves.setdefault(h, block)

    def _uncache(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None and self.cached.get(h) == block:
            del self.cached[h]
        self.block_hash[block] = None
