import pytest
import torch

from evenflow.engine.core.sequence import Sequence
from evenflow.engine.sample.sampler import sample
from evenflow.proto.sampling import SamplingParams


def seqs(*params):
    return [Sequence(str(i), [1], 1, p) for i, p in enumerate(params)]


def test_greedy_and_top_k_1_pick_the_argmax():
    logits = torch.randn(3, 50)
    out = sample(logits, seqs(SamplingParams(temperature=0), SamplingParams(top_k=1),
                              SamplingParams(top_p=1e-6)))
    assert out == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_whatever_shares_the_batch():
    logits = torch.randn(1, 100)
    lone, crowded = seqs(SamplingParams(seed=5), SamplingParams(seed=5))
    alone = [sample(logits, [lone])[0] for _ in range(6)]
    crowd = []
    for n in range(6):
        others = seqs(*[SamplingParams(seed=n) if n % 2 else SamplingParams()] * (n + 1))
        crowd.append(sample(torch.cat([torch.randn(n + 1, 100), logits]), others + [crowded])[-1])
    assert alone == crowd
    assert len(set(alone)) > 1  # it does sample


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, -10.0, -10.0]]).repeat(200, 1)
    params = [SamplingParams(top_k=2)] * 100 + [SamplingParams(top_p=0.7)] * 100
    out = sample(logits, seqs(*params))
    assert set(out[:100]) <= {0, 1} and len(set(out[:100])) == 2
    assert set(out[100:]) <= {0, 1}


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5),
                                 dict(top_k=-3), dict(max_tokens=0), dict(seed="x"),
                                 dict(stop=[3])])
def test_out_of_range_values_name_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)
