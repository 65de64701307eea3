"""Speculative decoding with n-gram and suffix drafts (engine/serving/speculation.py): greedy
output is the same as without it (float32 and bf16, with logprobs, stop tokens, max_tokens,
chunked prefill, int8 weights and the int8 KV cache, deterministic mode, tensor and expert
parallelism); seeded sampling with penalties and grammar-guided requests give the same text; a
draft on text that repeats is mostly accepted, and a repeated request drafts its earlier
answer; the sampling distribution is kept (chi-square over the verification of fixed rows);
rejected tokens never reach a KV event; a bad configuration is refused by name."""

from __future__ import annotations

import pytest
import torch
from checkpoints import VOCAB

from evenflow import LLM, SamplingParams
from evenflow.engine.core.sequence import Sequence
from evenflow.engine.sample.sampler import sample
from evenflow.engine.serving.engine import Engine, EngineConfig
from evenflow.engine.serving.speculation import Speculation
from evenflow.engine.spec.config import SpeculativeConfig
from evenflow.engine.spec.ngram import NgramProposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


pytestmark = pytest.mark.usefixtures("steady_row_cost")


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    piece = torch.randint(3, VOCAB, (6,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (37,), generator=g).tolist(), piece * 5,
            torch.randint(3, VOCAB, (9,), generator=g).tolist()]


def test_the_proposer_continues_the_latest_earlier_match():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3,
                                               prompt_lookup_min=2))
    assert proposer.propose([1, 2, 3, 4, 5, 9, 2, 3], 10) == [4, 5, 9]  # "2 3" -> "4 5 9"
    assert proposer.propose([7, 1, 2, 8, 1, 2, 6, 5, 1, 2], 10) == [6, 5, 1]  # the latest
    assert proposer.propose([1, 2, 3, 4, 5, 9, 2, 3], 2) == [4, 5]  # the limit
    assert proposer.propose([1, 2, 3, 4], 10) == []  # nothing recurs
    # the longest match wins over a later, shorter one: "1 2 3" -> "4 9 2", not "2 3" -> "5"
    assert proposer.propose([7, 1, 2, 3, 4, 9, 2, 3, 5, 7, 1, 2, 3], 10) == [4, 9, 2]


def tokens_and_logprobs(engine: Engine, params: SamplingParams) -> dict:
    """Each request's tokens, each with its logprobs' top ids, stepping the engine itself."""
    for i, p in enumerate(prompts()):
        engine.add_request(str(i), p, params)
    out: dict[str, list] = {}
    while engine.has_unfinished():
        for step in engine.step():
            top = tuple(step.logprobs.top_ids) if step.logprobs is not None else None
            out.setdefault(step.request_id, []).extend((t, top) for t in step.new_token_ids)
    return out


def test_suffix_drafts_come_from_earlier_requests_longer_for_longer_matches():
    from evenflow.engine.spec.suffix import SuffixProposer

    proposer = SuffixProposer(SpeculativeConfig(
        method="suffix", num_speculative_tokens=6, suffix_decoding_max_cached_requests=2))
    proposer.add([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert proposer.propose([9, 9, 3, 4], 10) == [5, 6]  # matched 2: at most 2
    assert proposer.propose([2, 3, 4], 10) == [5, 6, 7]  # matched 3: at most 3
    assert proposer.propose([7, 7, 4, 4, 7, 7], 10) == [4, 4]  # its own tokens first
    proposer.add([20, 21, 22])
    proposer.add([30, 31, 32])  # the first request drops out (capacity 2)
    assert proposer.propose([9, 9, 3, 4], 10) == []
    assert proposer.propose([5, 20, 21], 10) == [22]


def test_a_repeated_request_drafts_its_earlier_answer(gpt_oss):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = LLM(str(gpt_oss), dtype="float32", block_size=4)
    llm = LLM(str(gpt_oss), dtype="float32", block_size=4,
              speculative_config={"method": "suffix", "num_speculative_tokens": 8})
    first = prompts()[0]
    want = base.generate([first], params)[0].token_ids
    assert llm.generate([first], params)[0].token_ids == want
    counts = llm.engine.speculation.counts
    before = counts.accepted_tokens
    assert llm.generate([first], params)[0].token_ids == want  # the same request again
    assert counts.accepted_tokens - before >= 20


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_output_is_the_same_with_drafts(gpt_oss, dtype):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    config = dict(model=str(gpt_oss), dtype=dtype, block_size=4)
    base = tokens_and_logprobs(Engine(EngineConfig(**config)), params)
    engine = Engine(EngineConfig(**config, speculative_config=NGRAM))
    assert tokens_and_logprobs(engine, params) == base
    assert engine.speculation is not None
    counts = engine.speculation.counts
    assert counts.draft_tokens > 0 and counts.accepted_tokens > 0


def test_a_trained_model_copying_its_prompt_accepts_most_drafts():
    repeated = "copy : k 12 x to 40 hello please json 3 4 5 6 7 a b c d e f 100 200 ="
    params = SamplingParams(temperature=0, max_tokens=24)
    llm = LLM("tiny-moe", speculative_config=NGRAM)
    spec = llm.generate([repeated], params)[0]
    assert spec.text == LLM("tiny-moe").generate([repeated], params)[0].text
    counts = llm.engine.speculation.counts
    assert counts.accepted_tokens >= 0.5 * counts.draft_tokens > 0


@pytest.mark.parametrize("extra", [
    {"quantization": "int8"}, {"kv_cache_dtype": "int8"}, {"max_num_batched_tokens": 16},
])
def test_same_tokens_with_stops_and_the_engines_forms(gpt_oss, extra):
    """A stop token and max_tokens ending inside a draft, chunked prefill beside drafts, and
    quantized weights or cache."""
    base = LLM(str(gpt_oss), dtype="float32", block_size=4, **extra)
    first = base.generate(prompts()[1:2], SamplingParams(temperature=0, max_tokens=12,
                                                         ignore_eos=True))[0].token_ids
    cases = [SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[first[9]])]
    llm = LLM(str(gpt_oss), dtype="float32", block_size=4, speculative_config=NGRAM, **extra)
    for params in cases:
        want = [(o.token_ids, o.finish_reason) for o in base.generate(prompts(), params)]
        assert [(o.token_ids, o.finish_reason) for o in llm.generate(prompts(), params)] \
            == want, params


def test_sampling_keeps_the_target_distribution():
    """Verification of fixed rows, 20,000 times: the first token taken is distributed as row 0
    says (whatever the draft), and the second, given the first accepted, as row 1 says."""
    torch.manual_seed(0)
    vocab = 6
    rows = torch.randn(3, vocab) * 1.5
    draft = (2, 4)
    spec = Speculation(SpeculativeConfig(num_speculative_tokens=2))
    firsts, seconds = torch.zeros(vocab), torch.zeros(vocab)
    params = SamplingParams(temperature=1.0, max_tokens=100)
    for _ in range(20_000):
        seq = Sequence("r", [1, 2, 3], 3, params)
        taken = spec.verify(seq, rows, draft, lambda row, s=seq: sample(row, [s])[0],
                            lambda token: False)
        firsts[taken[0][0]] += 1
        if taken[0][0] == draft[0]:
            seconds[taken[1][0]] += 1
    for counts, row in ((firsts, rows[0]), (seconds, rows[1])):
        expected = row.softmax(-1) * counts.sum()
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 20.5, (chi2, counts, expected)  # p = 0.001 at 5 degrees of freedom


def test_rejected_tokens_never_reach_a_kv_event(gpt_oss):
    def stored(speculative: dict | None) -> set[tuple[int, ...]]:
        events = []
        engine = Engine(EngineConfig(model=str(gpt_oss), dtype="float32", block_size=4,
                                     speculative_config=speculative), events.extend)
        engine.add_request("a", prompts()[1], SamplingParams(temperature=0, max_tokens=30,
                                                             ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        return {tuple(e.token_ids) for e in events if hasattr(e, "token_ids")}

    assert stored(NGRAM) == stored(None)


def test_the_draft_length_follows_acceptance_and_cost():
    from evenflow.engine.serving.speculation import best_draft_length

    assert best_draft_length(0.9, 0.1, 4) == 4  # cheap rows, good guesses: the whole draft
    assert best_draft_length(0.1, 0.3, 4) == 0  # poor guesses: no draft
    assert 0 < best_draft_length(0.6, 0.5, 8) < 8  # in between: a few
    assert best_draft_length(0.99, 2.0, 4) == 0  # a row dearer than a step: never


def test_a_sequence_whose_drafts_fail_stops_drafting():
    spec = Speculation(SpeculativeConfig(num_speculative_tokens=4))
    seq = Sequence("r", [5, 6, 7, 5, 6, 7, 5, 6], 8, SamplingParams(temperature=0))
    first = spec.propose([(seq, 4)])[0]
    assert first and first == [7, 5, 6][: len(first)]  # (its length by the prior's cost)
    rows = torch.zeros(4, 10)
    rows[:, 1] = 1.0  # the target always says 1: every draft token is rejected
    for _ in range(6):
        spec.verify(seq, rows, (7, 5, 6), lambda row, s=seq: sample(row, [s])[0],
                    lambda token: False)
        seq.token_ids[-1:] = []  # (the same context again)
        seq.num_computed_tokens = 0
    assert spec.propose([(seq, 4)]) == [[]]


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle"}, "not built yet"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "max_spec_factor"),
    ({"method": "nope"}, "must be one of"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
    ({"k": 3}, "unknown field"),
    ("{not json", "not JSON"),
])
def test_a_bad_configuration_is_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=config)


@pytest.mark.slow  # rank processes loading models
@pytest.mark.parametrize("parallel, method", [
    ({"tensor_parallel_size": 2}, "ngram"), ({"expert_parallel_size": 2}, "ngram"),
    ({"tensor_parallel_size": 2}, "draft_model")])
def test_tensor_and_expert_parallel_engines_keep_the_tokens(gpt_oss, parallel, method):
    """TP: the leader drafts (a draft model whole, on the leader), and its followers run the
    rows it sends; DEP: each rank drafts for its own sequences, its one forward a step as the
    group's lockstep needs."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    config = dict(dtype="float32", block_size=4)
    want = [o.token_ids for o in LLM(str(gpt_oss), **config).generate(prompts(), params)]
    spec = NGRAM if method == "ngram" else {"model": str(gpt_oss), "num_speculative_tokens": 3}
    llm = LLM(str(gpt_oss), **config, **parallel, speculative_config=spec)
    try:
        assert [o.token_ids for o in llm.generate(prompts(), params)] == want
        if "tensor_parallel_size" in parallel:
            assert llm.engine.speculation.counts.accepted_tokens > 0
    finally:
        close = getattr(llm.engine, "close", None)
        if close is not None:
            close()


def test_seeded_sampling_penalties_and_grammars_give_the_same_text():
    """A seeded request draws once per token taken, with or without drafts: with penalties its
    sampled text is the same; under a grammar, draft tokens the grammar forbids are rejected."""
    from evenflow.proto.grammar import guide_grammar

    copy = "copy : k 12 x 40 hello please json 3 4 5 6 7 a b c d e f 100 200 ="
    schema = {"type": "object", "properties": {"name": {"type": "string"}},
              "required": ["name"], "additionalProperties": False}
    cases = [SamplingParams(temperature=0.8, seed=s, max_tokens=30, repetition_penalty=1.2,
                            presence_penalty=0.3) for s in (1, 2, 3)]
    cases.append(SamplingParams(temperature=0, max_tokens=40,
                                guide=guide_grammar("json_schema", schema)))
    base = LLM("tiny-moe", dtype="float32")
    llm = LLM("tiny-moe", dtype="float32", speculative_config=NGRAM)
    for params in cases:
        want = base.generate([copy, "json : name bob ="], params)
        got = llm.generate([copy, "json : name bob ="], params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], params
    assert llm.engine.speculation.counts.accepted_tokens > 0


def test_deterministic_mode_keeps_its_tokens_with_drafts():
    params = SamplingParams(temperature=0, max_tokens=30)
    prompts_ = ["copy : k 12 x 40 hello please 3 4 5 a b c d =", "count from 17 :"]
    base = LLM("tiny-moe", deterministic=True)
    llm = LLM("tiny-moe", deterministic=True, speculative_config=NGRAM)
    assert [o.token_ids for o in llm.generate(prompts_, params)] == \
        [o.token_ids for o in base.generate(prompts_, params)]
    assert llm.engine.speculation.counts.accepted_tokens > 0
