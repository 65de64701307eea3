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

from typing import Any

import torch
from torch import Tensor

from evenflow.engine.core.sequence import Sequence
from evenflow.proto.sampling import TokenLogprobs


def _pairs(lists: list[list[int]], rows: list[int], vocab: int) -> tuple[Tensor, Tensor, Tensor]:
    """The distinct (row, token) pairs of the lists (list j belongs to logits row rows[j]), and
    how often each occurs: sparse, so the cost follows the tokens, not the vocabulary."""
    flat = torch.tensor([t for ids in lists for t in ids], dtype=torch.long)
    owner = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long),
                                    torch.tensor([len(ids) for ids in lists]))
    keys, counts = torch.unique(owner * vocab + flat, return_counts=True)
    return keys // vocab, keys % vocab, counts


def process(logits: Tensor, seqs: list[Sequence], eos_ids: frozenset[int] | set[int]) -> Tensor:
    """logits (S, V) float32, one row per sequence -> the processed logits (a new tensor only
    when some row asks for processing)."""
    asking = [i for i, s in enumerate(seqs) if s.params.processes_logits]
    if not asking:
        return logits
    vocab = logits.shape[1]
    out = logits.clone()
    per_row = torch.zeros(len(seqs))  # a per-sequence setting, by logits row

    def setting(rows: list[int], values: list[float]) -> Tensor:
        table = per_row.clone()
        table[rows] = torch.tensor(values)
        return table

    rep = [i for i in asking if seqs[i].params.repetition_penalty != 1.0]
    if rep:  # over the prompt and the output, as vLLM does
        r, t, _ = _pairs([seqs[i].token_ids for i in rep], rep, vocab)
        penalty = setting(rep, [seqs[i].params.repetition_penalty for i in rep])[r]
        values = out[r, t]
        out[r, t] = torch.where(values > 0, values / penalty, values * penalty)
    pf = [i for i in asking if seqs[i].params.presence_penalty or seqs[i].params.frequency_penalty]
    if pf:
        r, t, counts = _pairs([seqs[i].output_token_ids for i in pf], pf, vocab)
        presence = setting(pf, [seqs[i].params.presence_penalty for i in pf])[r]
        frequency = setting(pf, [seqs[i].params.frequency_penalty for i in pf])[r]
        out.index_put_((r, t), -(presence + frequency * counts), accumulate=True)
    bias_rows, bias_ids, bias_values = [], [], []
    for i in asking:
        bias = seqs[i].params.logit_bias
        for token, value in (bias.items() if isinstance(bias, dict) else bias):
            bias_rows.append(i)
            bias_ids.append(token)
            bias_values.append(value)
    if bias_rows:
        out.index_put_((torch.tensor(bias_rows), torch.tensor(bias_ids)),
                       torch.tensor(bias_values, dtype=out.dtype), accumulate=True)
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for i in asking:  # EOS and stop tokens until min_tokens outputs
        p = seqs[i].params
        if seqs[i].num_output_tokens < p.min_tokens:
            banned = {*eos_ids, *p.stop_token_ids}
            ban_rows += [i] * len(banned)
            ban_ids += banned
    if ban_rows:
        out[torch.tensor(ban_rows), torch.tensor(ban_ids)] = float("-inf")
    for i in asking:
        allowed = seqs[i].params.allowed_token_ids
        if allowed:
            keep = out[i, list(allowed)]
            out[i] = float("-inf")
            out[i, list(allowed)] = keep
    return out


def record_logprobs(logits: Tensor, seqs: list[Sequence], tokens: list[int]) -> None:
    """Set `seq.step_logprobs` (the chosen token's logprob, top ids, top logprobs) for every
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
        seqs[i].step_logprobs = TokenLogprobs(picked[j], ids[j][:n], values[j][:n])


def record_prompt_logprobs(seq: Sequence, chunk: Any, logits: Tensor) -> None:
    """From a prompt chunk's every-row logits (row i predicts the token after chunk.start + i),
    append each not yet recorded prompt token's TokenLogprobs to
    seq.prompt_logprobs (a recomputation after preemption adds nothing twice)."""
    first = len(seq.prompt_logprobs) + 1  # the next prompt position without a logprob
    positions = [chunk.start + i + 1 for i in range(logits.shape[0])]
    rows = [i for i, p in enumerate(positions) if first <= p < seq.num_prompt_tokens]
    if not rows:
        return
    lp = torch.log_softmax(logits[rows].float(), dim=-1)
    targets = torch.tensor([seq.token_ids[positions[i]] for i in rows]).unsqueeze(1)
    picked = lp.gather(1, targets)[:, 0].tolist()
    n = seq.params.prompt_logprobs or 0
    if n:
        values, ids = lp.topk(n, dim=-1)
        top_v, top_i = values.tolist(), ids.tolist()
    else:
        top_v = top_i = [[] for _ in rows]
    seq.prompt_logprobs += [TokenLogprobs(p, i, v) for p, i, v in zip(picked, top_i, top_v,
                                                                        strict=True)]
