"""What one worker of each role costs on this machine, as the planner sizes pools with it: a
prefill worker's seconds per uncached prompt token, and a decode step's fixed seconds plus its
seconds per running sequence. `evenflow profile-roles` measures them from the real engine and
writes them as JSON (with the machine they were measured on); without a file, the planner
measures them online from the workers' heartbeats (`OnlineProfile`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace


@dataclass(frozen=True)
class RoleProfile:
    prefill_s_per_token: float = 0.0001  # (the mock engine's defaults until measured)
    decode_s_base: float = 0.004
    decode_s_per_seq: float = 0.0002
    worker_start_s: float = 0.0  # a worker process's start to ready (the launcher's restart)

    @classmethod
    def load(cls, path: str) -> RoleProfile:
        with open(path) as f:
            data = json.load(f)
        return cls(**{f.name: float(data[f.name]) for f in fields(cls) if f.name in data})

    def save(self, path: str, **about: object) -> None:
        with open(path, "w") as f:
            json.dump({**asdict(self), **about}, f, indent=2)

    def itl_s(self, streams: float) -> float:
        """A decode step's time (one token per stream) at this many streams."""
        return self.decode_s_base + self.decode_s_per_seq * max(0.0, streams)


@dataclass
class OnlineProfile:
    """The profile measured from heartbeats: prefill seconds per token from prefill workers'
    step time over the prompt tokens they computed (intervals with enough tokens only), and the
    decode step's time against the streams running, fitted by least squares over intervals
    (exponentially weighted). Starts from `prior`, which it keeps where it has no evidence."""

    prior: RoleProfile
    decay: float = 0.9  # each interval's weight against the ones before
    _prefill: tuple[float, float] = (0.0, 0.0)  # weighted (seconds, tokens)
    _decode: list[float] | None = None  # weighted sums: n, b, t, bb, bt

    def add_prefill(self, step_s: float, prompt_tokens: int) -> None:
        if prompt_tokens >= 256 and step_s > 0:
            s, t = self._prefill
            self._prefill = (s * self.decay + step_s, t * self.decay + prompt_tokens)

    def add_decode(self, streams: float, step_s_per_token: float) -> None:
        if streams <= 0 or step_s_per_token <= 0:
            return
        sums = [x * self.decay for x in (self._decode or [0.0] * 5)]
        for i, v in enumerate((1.0, streams, step_s_per_token, streams * streams,
                               streams * step_s_per_token)):
            sums[i] += v
        self._decode = sums

    def current(self) -> RoleProfile:
        profile = self.prior
        seconds, tokens = self._prefill
        if tokens > 0:
            profile = replace(profile, prefill_s_per_token=seconds / tokens)
        if self._decode is not None:
            n, b, t, bb, bt = self._decode
            spread = bb * n - b * b
            if n >= 3 and spread > 1e-9 * n * n:  # enough different stream counts: a line
                slope = (bt * n - b * t) / spread
                if slope > 0:
                    base = max(0.0, (t - slope * b) / n)
                    return replace(profile, decode_s_base=base, decode_s_per_seq=slope)
            # one stream count: keep the prior's shape, scaled to what was measured
            mean_b, mean_t = b / n, t / n
            modelled = profile.itl_s(mean_b)
            if modelled > 0:
                k = mean_t / modelled
                profile = replace(profile, decode_s_base=profile.decode_s_base * k,
                                  decode_s_per_seq=profile.decode_s_per_seq * k)
        return profile
