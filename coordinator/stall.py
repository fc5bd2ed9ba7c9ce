"""When a chain that has not answered counts as hung: a bound from its own measured step times.

Owns the recent service times of one chain's steps (from the moment a step could start, its
send or the answer before it, whichever is later, to its answer) and the bound they give: a floor,
or a multiple of the recent p99 for a step of that size, whichever is larger. Decode-sized steps
are judged by their own p99; a larger step by that plus its tokens times the recent p90 cost of
a token in large steps. Until enough steps have been seen, the bound is generous: the first
steps of a chain include warm-up, and a wrong verdict moves every sequence on it.

Knows nothing of gRPC, of the chain's workers or of what is done about a hang.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

SMALL_STEP_TOKENS = 64  # a step of at most this many tokens is judged as a decode step


@dataclass(frozen=True)
class StallPolicy:
    floor: float = 1.0  # seconds: no step is called hung sooner
    multiple: float = 3.0  # times the recent p99 a step may take
    initial: float = 30.0  # seconds, until `min_samples` steps of the size were seen
    min_samples: int = 16
    window: int = 512  # recent steps remembered, of each kind


class StallBound:
    def __init__(self, policy: StallPolicy = StallPolicy()) -> None:
        self.policy = policy
        self._small: deque[float] = deque(maxlen=policy.window)  # seconds per decode-sized step
        self._per_token: deque[float] = deque(maxlen=policy.window)  # seconds per token of larger steps

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= SMALL_STEP_TOKENS:
            self._small.append(seconds)
        else:
            self._per_token.append(seconds / tokens)

    def allowed(self, tokens: int) -> float:
        """Seconds a step of `tokens` tokens may take before its chain counts as hung."""
        p = self.policy
        if len(self._small) < p.min_samples:
            return p.initial
        expected = _quantile(self._small, 0.99)
        if tokens > SMALL_STEP_TOKENS:
            if len(self._per_token) < p.min_samples // 4:
                return p.initial
            expected += tokens * _quantile(self._per_token, 0.9)
        return max(p.floor, p.multiple * expected)


def _quantile(values: deque[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
