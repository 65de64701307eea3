"""A request's replies at the gateway, before they are streamed: `Ordering` puts one attempt's
deltas in output order (holding one that overtook its predecessor, noticing one lost), and
`DeltaQueue` joins the deltas a slow consumer has not taken yet into one."""

from __future__ import annotations

import asyncio
import dataclasses

from evenflow.proto.messages import ErrorMessage, TokenDelta


def merge_deltas(first: TokenDelta, then: TokenDelta) -> TokenDelta | None:
    """`first` followed by `then` as one delta, when `then` continues it exactly (same attempt,
    next positions, `first` not finished); else None."""
    if (first.request_id != then.request_id or first.finish_reason is not None
            or first.first_index < 0 or then.first_index != first.first_index
            + len(first.token_ids) or then.prompt_logprobs
            or bool(first.logprobs) != bool(then.logprobs)):
        return None
    return dataclasses.replace(
        first, token_ids=first.token_ids + then.token_ids, finish_reason=then.finish_reason,
        logprobs=first.logprobs + then.logprobs,
        top_logprob_ids=first.top_logprob_ids + then.top_logprob_ids,
        top_logprobs=first.top_logprobs + then.top_logprobs,
        draft_tokens=first.draft_tokens + then.draft_tokens,
        accepted_draft_tokens=first.accepted_draft_tokens + then.accepted_draft_tokens)


class DeltaQueue(asyncio.Queue):
    """A request's replies. A delta arriving while the one before it still waits to be taken
    joins it (as vLLM's output collector merges outputs for a slow consumer): a gateway that
    falls behind renders and writes one SSE event for several steps' tokens, not one each."""

    def _put(self, item: TokenDelta | ErrorMessage) -> None:
        waiting = self._queue  # type: ignore[attr-defined]
        if waiting and isinstance(item, TokenDelta) and isinstance(waiting[-1], TokenDelta):
            merged = merge_deltas(waiting[-1], item)
            if merged is not None:
                waiting[-1] = merged
                return
        waiting.append(item)


GAP_WAIT_S = 1.0  # a delta ahead of its predecessor waits this long for it before it counts lost


class Ordering:
    """One attempt's deltas in output order (TokenDelta.first_index). A delta that arrives
    ahead of its predecessor is held until the predecessor comes, for at most GAP_WAIT_S (two
    workers answer one request: the prefill worker's first token and the decode worker's
    next ones); a hole that stays means a delta was lost (a NATS restart) and the request is
    sent again. Repeated tokens are trimmed."""

    def __init__(self) -> None:
        self.reset(0)

    def reset(self, base: int) -> None:
        self.base = base  # tokens streamed before this attempt
        self.held: dict[int, TokenDelta] = {}
        self.hole_since: float | None = None

    def next_held(self, emitted: int) -> TokenDelta | None:
        delta = self.held.pop(emitted - self.base, None)
        if not self.held:
            self.hole_since = None
        return delta

    def lost(self, now: float) -> bool:
        return self.hole_since is not None and now - self.hole_since > GAP_WAIT_S

    def admit(self, delta: TokenDelta, emitted: int, now: float) -> TokenDelta | None:
        """The delta to stream now (trimmed of repeats), or None (held, or nothing new)."""
        expected = emitted - self.base
        if delta.first_index > expected:
            self.held.setdefault(delta.first_index, delta)
            self.hole_since = self.hole_since or now
            return None
        skip = expected - delta.first_index
        if skip == 0:
            return delta
        if skip >= len(delta.token_ids) and delta.finish_reason is None:
            return None
        return dataclasses.replace(delta, token_ids=delta.token_ids[skip:], first_index=expected,
                                   logprobs=delta.logprobs[skip:],
                                   top_logprob_ids=delta.top_logprob_ids[skip:],
                                   top_logprobs=delta.top_logprobs[skip:])
