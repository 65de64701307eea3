"""Next-token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, after the
logits processing a request asks for (penalties, logit_bias, ...:
engine/sample/logits_processing.py), and the logprobs it asks for.

Sampling uses the exponential-race form (argmax of p / E with E ~ Exp(1)), which equals drawing
from p. A seeded request draws its noise from its own generator, so its output does not depend on
what else shares the batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from evenflow.engine.core.sequence import Sequence
from evenflow.engine.sample.guided import Guides
from evenflow.engine.sample.logits_processing import process, record_logprobs


def _filter_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """logits (S, V); top_k (S,) with V meaning off; top_p (S,) with 1 meaning off."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1]).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Drop a token once the mass strictly before it already reaches top_p (the first always stays).
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: Tensor, seqs: list[Sequence],
           eos_ids: frozenset[int] | set[int] = frozenset(),
           guides: Guides | None = None) -> list[int]:
    """logits (S, V) float32, one row per sequence -> one token id per sequence. Guided rows
    draw only what their grammar allows; their logprobs are the model's (before the mask)."""
    logits = process(logits, seqs, eos_ids)
    allowed = guides.mask(logits, seqs) if guides is not None else logits
    tokens = _draw(allowed, seqs)
    record_logprobs(logits, seqs, tokens)
    if guides is not None and allowed is not logits:
        guides.advance(seqs, tokens)
    return tokens


def _draw(logits: Tensor, seqs: list[Sequence]) -> list[int]:
    greedy = logits.argmax(dim=-1)
    if all(s.params.greedy for s in seqs):
        return greedy.tolist()
    vocab = logits.shape[-1]
    temps = torch.tensor([s.params.temperature or 1.0 for s in seqs]).unsqueeze(1)
    scaled = logits / temps
    top_k = torch.tensor([min(s.params.top_k, vocab) if s.params.top_k > 0 else vocab
                          for s in seqs])
    top_p = torch.tensor([s.params.top_p for s in seqs])
    if bool((top_k < vocab).any() or (top_p < 1).any()):
        scaled = _filter_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    min_p = torch.tensor([s.params.min_p for s in seqs])
    if bool((min_p > 0).any()):
        floor = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    noise = torch.empty_like(probs).exponential_()
    for row, seq in enumerate(seqs):
        if seq.generator is not None:
            noise[row].exponential_(generator=seq.generator)
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = torch.tensor([s.params.greedy for s in seqs])
    return torch.where(is_greedy, greedy, sampled).tolist()
