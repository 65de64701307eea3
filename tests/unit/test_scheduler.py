"""The continuous-batching scheduler on its own (no model): token budget, chunked prefill,
the running cap, prefix hits, deferral of a shared prefix in flight, preemption, finishing."""

from __future__ import annotations

from evenflow.engine.core.block_manager import BlockManager
from evenflow.engine.core.scheduler import Scheduler, SchedulerConfig
from evenflow.engine.core.sequence import FinishReason, Sequence, SequenceStatus
from evenflow.proto.sampling import SamplingParams

BS = 4  # block size


def seq(tokens, rid: str) -> Sequence:
    tokens = list(tokens)
    return Sequence(rid, tokens, len(tokens), SamplingParams(max_tokens=100))


def scheduler(num_blocks: int = 64, budget: int = 2048, max_seqs: int = 64,
              defer: bool = True) -> Scheduler:
    return Scheduler(SchedulerConfig(max_seqs, budget, 4096, defer),
                     BlockManager(num_blocks, BS))


def run(s: Scheduler, chunks, sampled_token: int = 7) -> None:
    """What the engine does after a forward pass: count computed tokens, commit full blocks,
    append a token to sequences that sampled."""
    for c in chunks:
        samples = c.samples
        c.seq.num_computed_tokens += c.num_tokens
        s.blocks.commit_full_blocks(c.seq)
        if samples:
            c.seq.token_ids.append(sampled_token)


def test_prefill_is_chunked_by_the_token_budget_and_decodes_follow():
    s = scheduler(budget=8)
    a = seq(range(20), "a")
    s.add(a)
    sizes = []
    for _ in range(4):
        chunks = s.schedule()
        sizes.append([(c.seq.request_id, c.num_tokens, c.samples) for c in chunks])
        run(s, chunks)
    assert sizes == [[("a", 8, False)], [("a", 8, False)], [("a", 4, True)], [("a", 1, True)]]


def test_running_sequences_go_first_and_prefills_lead_the_batch():
    s = scheduler(budget=16)
    a = seq(range(10), "a")
    s.add(a)
    run(s, s.schedule())  # a prefilled; decodes from now on
    s.add(seq(range(100, 110), "b"))
    chunks = s.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in chunks] == [("b", 10), ("a", 1)]


def test_the_running_cap_keeps_the_rest_waiting():
    s = scheduler(max_seqs=2)
    for i in range(3):
        s.add(seq(range(i * 10, i * 10 + 5), str(i)))
    chunks = s.schedule()
    assert [c.seq.request_id for c in chunks] == ["0", "1"]
    assert [q.request_id for q in s.waiting] == ["2"]


def test_a_cached_prefix_is_not_computed_again():
    s = scheduler()
    first = seq(range(13), "first")
    s.add(first)
    run(s, s.schedule())
    s.finish(first, FinishReason.STOP)
    again = seq([*range(12), 99], "again")
    s.add(again)
    (chunk,) = s.schedule()
    assert again.num_cached_tokens == 12 and chunk.num_tokens == 1


def test_a_burst_sharing_a_new_prefix_computes_it_once():
    s = scheduler()
    shared = list(range(40))
    a, b = seq([*shared, 1], "a"), seq([*shared, 2], "b")
    s.add(a)
    s.add(b)
    first = s.schedule()
    assert [c.seq.request_id for c in first] == ["a"]  # b waits for a's blocks
    run(s, first)
    second = s.schedule()
    b_chunk = next(c for c in second if c.seq is b)
    assert b.num_cached_tokens == 40 and b_chunk.num_tokens == 1


def test_without_deferral_both_compute_the_prefix():
    s = scheduler(defer=False)
    shared = list(range(40))
    s.add(seq([*shared, 1], "a"))
    s.add(seq([*shared, 2], "b"))
    assert [c.num_tokens for c in s.schedule()] == [41, 41]


def test_out_of_blocks_preempts_the_newest_and_recomputes_it_later():
    s = scheduler(num_blocks=4)  # 16 token slots
    a, b = seq(range(8), "a"), seq(range(100, 107), "b")
    s.add(a)
    s.add(b)
    run(s, s.schedule())  # a: 2 blocks + 1 for its first new token soon; b: 2 blocks
    for _ in range(3):
        run(s, s.schedule())
    assert s.num_preemptions >= 1 and b.status is SequenceStatus.WAITING
    assert b.num_computed_tokens == 0 and b.num_preemptions >= 1
    s.finish(a, FinishReason.STOP)
    (chunk,) = s.schedule()
    assert chunk.seq is b and s.blocks.num_free_blocks < 4


def test_finish_frees_blocks_and_leaves_the_queues():
    s = scheduler(num_blocks=8)
    a = seq(range(9), "a")
    s.add(a)
    s.schedule()
    s.finish(a, FinishReason.ABORT)
    assert not s.has_unfinished() and s.blocks.num_free_blocks == 8
    assert a.finish_reason is FinishReason.ABORT


# -- priority (lower is sooner) -----------------------------------------------------------------

def pseq(tokens, rid: str, priority: int) -> Sequence:
    tokens = list(tokens)
    return Sequence(rid, tokens, len(tokens), SamplingParams(max_tokens=100, priority=priority))


def test_waiting_requests_are_admitted_best_priority_first_ties_in_arrival_order():
    s = scheduler(max_seqs=3)
    for i, (rid, priority) in enumerate((("low", 5), ("high", -1), ("mid-a", 0), ("mid-b", 0))):
        s.add(pseq(range(100 * i, 100 * i + 4), rid, priority))
    # a step that admits a better priority admits nothing worse (its prefill goes alone)
    steps = []
    for _ in range(3):
        chunks = s.schedule()
        steps.append([c.seq.request_id for c in chunks if c.num_tokens > 1])
        run(s, chunks)
    assert steps == [["high"], ["mid-a", "mid-b"], []]  # the cap (3) keeps "low" waiting


def test_a_high_priority_arrival_preempts_a_running_low_priority_request_when_kv_is_full():
    s = scheduler(num_blocks=4)  # 16 tokens of KV
    low = pseq(range(12), "low", 10)
    s.add(low)
    run(s, s.schedule())  # low holds 3 blocks and decodes
    high = pseq(range(100, 108), "high", 0)  # needs 2 blocks: 1 is free
    s.add(high)
    chunks = s.schedule()
    assert [c.seq.request_id for c in chunks] == ["high"]
    assert low.status == SequenceStatus.WAITING and low.num_computed_tokens == 0
    assert s.num_priority_preemptions == 1
    run(s, chunks)
    s.finish(high, FinishReason.STOP)
    # the preempted one comes back (its full blocks are prefix hits) and completes
    assert [c.seq.request_id for c in s.schedule()] == ["low"]


def test_an_equal_or_lower_priority_arrival_waits_instead_of_preempting():
    s = scheduler(num_blocks=4)
    first = pseq(range(12), "first", 1)
    s.add(first)
    run(s, s.schedule())
    s.add(pseq(range(100, 108), "same", 1))
    s.add(pseq(range(200, 208), "worse", 2))
    assert [c.seq.request_id for c in s.schedule()] == ["first"]
    assert s.num_priority_preemptions == 0


def test_the_running_cap_is_made_room_in_for_a_better_priority():
    s = scheduler(max_seqs=1)
    low = pseq(range(4), "low", 3)
    s.add(low)
    run(s, s.schedule())
    s.add(pseq(range(100, 104), "high", -3))
    assert [c.seq.request_id for c in s.schedule()] == ["high"]
    assert low in s.waiting


def test_memory_pressure_preempts_the_lowest_priority_running_request_first():
    s = scheduler(num_blocks=5, budget=64)
    # three sequences of 5 tokens (2 blocks each once they grow): the lowest priority goes
    a, b, c = pseq(range(4), "a", 0), pseq(range(10, 14), "b", 9), pseq(range(20, 24), "c", 1)
    for x in (a, b, c):
        s.add(x)
    run(s, s.schedule())  # 3 blocks used, each sequence now 5 tokens: a second block each
    chunks = s.schedule()
    assert {ch.seq.request_id for ch in chunks} == {"a", "c"}
    assert b.status == SequenceStatus.WAITING


def test_waiting_ages_so_a_low_priority_request_is_not_starved(monkeypatch):
    import evenflow.engine.core.scheduler as sched

    now = [1000.0]
    monkeypatch.setattr(sched.time, "monotonic", lambda: now[0])
    s = Scheduler(SchedulerConfig(1, 2048, 4096, True, priority_aging_s=1.0),
                  BlockManager(64, BS))
    old = pseq(range(4), "old", 3)
    s.add(old)
    s.add(blocker := pseq(range(50, 54), "blocker", 0))
    assert [c.seq.request_id for c in s.schedule()] == ["blocker"]
    s.finish(blocker, FinishReason.STOP)
    now[0] += 5.0  # "old" waited 5 s: 3 - 5 = -2, ahead of a fresh priority-0 arrival
    s.add(pseq(range(60, 64), "fresh", 0))
    assert [c.seq.request_id for c in s.schedule()] == ["old"]


def test_all_priorities_zero_is_plain_fifo():
    s = scheduler(max_seqs=2)
    for i in range(4):
        s.add(seq(range(10 * i, 10 * i + 4), f"r{i}"))
    assert [c.seq.request_id for c in s.schedule()] == ["r0", "r1"]
    assert s._prioritized == 0
