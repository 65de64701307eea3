"""What a request asks of the next-token distribution beyond temperature, top-k, top-p and
min-p, applied to a batch's logits in a few tensor ops: presence, frequency and repetition
penalties, logit_bias, allowed_token_ids, and min_tokens (EOS and stop tokens masked until the
request has that many output tokens). Rows that ask for none of it are left alone, and a batch in
which no request asks costs one pass over its requests' flags.

Also the log-probabilities a request asks for (`logprobs`: the chosen token's and the top N),
taken from the same processed logits the token is sampled from (before temperature), as vLLM
does by default.
"""

from __future__ import annotations

import torch
from torch import Tensor

from evenflow.engine.sequence import Sequence


def _padded(lists: list[list[int]], pad: int) -> Tensor:
    """(rows, max length) long tensor of the lists, padded with `pad`."""
    width = max(1, max(len(x) for x in lists))
    out = torch.full((len(lists), width), pad, dtype=torch.long)
    for row, ids in enumerate(lists):
        if ids:
            out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


def _occurrences(lists: list[list[int]], vocab: int) -> Tensor:
    """(rows, vocab) how often each token occurs in each list."""
    ids = _padded(lists, vocab)
    counts = torch.zeros(len(lists), vocab + 1)
    counts.scatter_add_(1, ids, torch.ones(ids.shape))
    return counts[:, :vocab]


def process(logits: Tensor, seqs: list[Sequence], eos_ids: frozenset[int] | set[int]) -> Tensor:
    """logits (S, V) float32, one row per sequence -> the processed logits (a new tensor only
    when some row asks for processing)."""
    rows = [i for i, s in enumerate(seqs) if s.params.processes_logits]
    if not rows:
        return logits
    vocab = logits.shape[1]
    chosen = [seqs[i] for i in rows]
    params = [s.params for s in chosen]
    sub = logits[rows]  # a copy
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = _occurrences([s.token_ids for s in chosen], vocab) > 0  # prompt and output
        penalty = torch.tensor([p.repetition_penalty for p in params]).unsqueeze(1)
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        counts = _occurrences([s.output_token_ids for s in chosen], vocab)
        presence = torch.tensor([p.presence_penalty for p in params]).unsqueeze(1)
        frequency = torch.tensor([p.frequency_penalty for p in params]).unsqueeze(1)
        sub = sub - presence * (counts > 0) - frequency * counts
    bias_rows, bias_ids, bias_values = [], [], []
    for r, p in enumerate(params):
        pairs = p.logit_bias.items() if isinstance(p.logit_bias, dict) else p.logit_bias
        for token, value in pairs:
            bias_rows.append(r)
            bias_ids.append(token)
            bias_values.append(value)
    if bias_rows:
        sub.index_put_((torch.tensor(bias_rows), torch.tensor(bias_ids)),
                       torch.tensor(bias_values, dtype=sub.dtype), accumulate=True)
    banned: list[list[int]] = []
    for s, p in zip(chosen, params, strict=True):
        ban: list[int] = []
        if s.num_output_tokens < p.min_tokens:
            ban = [*eos_ids, *p.stop_token_ids]
        banned.append(ban)
    if any(banned):
        sub = sub.masked_fill(_occurrences(banned, vocab) > 0, float("-inf"))
    allowed = [list(p.allowed_token_ids) if p.allowed_token_ids else list(range(vocab))
               for p in params]
    if any(p.allowed_token_ids for p in params):
        sub = sub.masked_fill(_occurrences(allowed, vocab) == 0, float("-inf"))
    out = logits.clone()
    out[rows] = sub
    return out


def record_logprobs(logits: Tensor, seqs: list[Sequence], tokens: list[int]) -> None:
    """Set `seq.step_logprobs` = (chosen token's logprob, top ids, top logprobs) for every
    sequence that asks for logprobs (params.logprobs = how many top ones, 0: the chosen only)."""
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not rows:
        return
    lp = torch.log_softmax(logits[rows].float(), dim=-1)
    picked = lp.gather(1, torch.tensor([tokens[i] for i in rows]).unsqueeze(1))[:, 0].tolist()
    top_n = max(seqs[i].params.logprobs or 0 for i in rows)
    top_values, top_ids = (lp.topk(top_n, dim=-1) if top_n else
                           (torch.zeros(len(rows), 0), torch.zeros(len(rows), 0, dtype=torch.long)))
    values, ids = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        n = seqs[i].params.logprobs or 0
        seqs[i].step_logprobs = (picked[j], ids[j][:n], values[j][:n])
