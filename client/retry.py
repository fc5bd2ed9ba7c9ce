"""When the SDK makes a call again, and how long it waits first: the retry policy of both clients.

Owns `Limits` (how long a call may take and how often it may be made again) and `Attempts`, the
attempts of one call: their bound, the wait before each next one (the server's retry hint when
it gave one, else exponential backoff with jitter), and the call's deadline, which no attempt and
no wait passes. A call is made again only for the statuses that say "not now", and only while
nothing of its answer has arrived: once a token has, the coordinator has already done its work
and moved the sequence off any failed worker (failover), so a later error is the call's last word.

- Generating calls retry UNAVAILABLE (the coordinator is not up, or no chain of workers serves)
  and RESOURCE_EXHAUSTED (the coordinator's queue is full; its hint says how long to wait).
- `models()` and `cluster()` retry UNAVAILABLE only: they pass no admission, so a
  RESOURCE_EXHAUSTED there is a message-size limit that no retry changes. `health()` is never
  retried: "the server is not up" is the answer it is asked for.

Each retry is logged at INFO on the `layerline.client` logger. Knows nothing of channels,
threads or event loops: `sync` and `aio` make the calls and wait.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from .errors import LayerlineError, ResourceExhausted

DEFAULT_RETRIES = 3  # calls made again at most, after the first; 0: never
FIRST_BACKOFF = 0.2  # seconds before the first retry when the server gave no hint; doubles with each retry
MAX_BACKOFF = 5.0  # seconds: the longest wait without a hint
GENERATE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})
INFO_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})

log = logging.getLogger("layerline.client")


@dataclass(frozen=True)
class Limits:
    """How long one call may take and how often it may be made again."""

    timeout: float  # seconds the whole call may take, its retries and the waits before them included
    retries: int  # calls made again at most, after the first


def backoff(retry: int, *, rng: Callable[[], float] = random.random) -> float:
    """Seconds before retry number `retry` (1, 2, ...) when the server gave no hint.

    FIRST_BACKOFF doubling with each retry up to MAX_BACKOFF, drawn at random from the upper half
    of that (`rng` gives [0, 1)), so that callers refused together do not all come back together.
    """
    ceiling = min(MAX_BACKOFF, FIRST_BACKOFF * 2.0 ** (retry - 1))
    return ceiling * (0.5 + 0.5 * rng())


class Attempts:
    """The attempts of one call, started when it is made (the deadline runs from then)."""

    def __init__(
        self,
        limits: Limits,
        codes: frozenset[grpc.StatusCode],
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.limits = limits
        self.codes = codes  # the statuses this call is made again for
        self.made = 0  # attempts started
        self._clock = clock
        self._rng = rng
        self._deadline = clock() + limits.timeout

    def start(self) -> float:
        """Counts one more attempt; the seconds it may take: what is left of the call's timeout."""
        self.made += 1
        return max(self._deadline - self._clock(), 0.001)

    def wait_before_retry(self, error: LayerlineError, *, answered: bool = False) -> float | None:
        """Seconds to wait before making the call again after `error`, or None when `error` ends it:
        part of the answer had arrived (`answered`), its status is not retried, the retries are
        spent, or the wait would end past the call's deadline. Sets `error.attempts`."""
        error.attempts = self.made
        retry = self.made  # the number of the retry this wait would come before
        if answered or error.code not in self.codes or retry > self.limits.retries:
            return None
        hint = error.retry_after if isinstance(error, ResourceExhausted) else None
        wait = hint if hint is not None else backoff(retry, rng=self._rng)
        if self._clock() + wait >= self._deadline:
            return None
        log.info("%s; retry %d of %d in %.2f s", error, retry, self.limits.retries, wait)
        return wait
