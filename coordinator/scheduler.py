"""Continuous batching with several micro-batches in flight per chain.

Owns, for one chain, which live sequences advance in each step: decode tokens first, then
chunks of prompts under a per-step token budget, so a long prompt never stalls the decoding of
others. Up to `depth` micro-batches are in flight at once (default: the chain's length), each
with different sequences, so every stage has work while the others compute. Sequences join
and leave between steps.

Knows nothing of text, of gRPC or of the wire: it hands `PlannedStep`s to a `StepSender` and
gets `Outcome`s back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from layerline.sampling import SamplingParams

log = logging.getLogger(__name__)

# A new sequence whose first tokens equal this many or more of a live sequence's on the same
# chain (a shared system prompt, the same question twice) copies their KV instead of computing it.
MIN_SHARED_PREFIX = 4


@dataclass
class Sequence:
    """A sequence's token history (the ground truth its KV can be rebuilt from) and progress."""

    sequence_id: str
    prompt: list[int]
    sampling: SamplingParams
    on_token: Callable[[int, float | None, list[tuple[int, float]]], None]  # called per new token
    on_error: Callable[[int, str], None]  # (grpc status code value, message)
    generated: list[int] = field(default_factory=list)
    fed: int = 0  # tokens of the history whose KV the chain holds
    in_flight: bool = False
    lent: int = 0  # steps in flight that copy a prefix of its KV: it is released after them
    done: bool = False
    moves: int = 0  # times it was moved to another chain after a failure
    failed_at: float | None = None  # when its chain failed, until its next token arrives
    trace_context: dict[str, str] = field(default_factory=dict)

    @property
    def history(self) -> list[int]:
        return self.prompt + self.generated


@dataclass(frozen=True)
class Slice:
    seq: Sequence
    start: int  # first position fed
    token_ids: tuple[int, ...]
    sample: bool  # the chain samples the token after this slice
    prefix_from: Sequence | None = None  # whose KV of positions [0, start) each stage copies first


@dataclass(frozen=True)
class PlannedStep:
    slices: tuple[Slice, ...]


@dataclass(frozen=True)
class Outcome:
    """What came back for one sequence of a step."""

    sequence_id: str
    token_id: int | None = None
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    error_code: int = 0
    error_message: str = ""


class StepSender(Protocol):
    def __call__(self, step: PlannedStep) -> Awaitable[list[Outcome]]: ...


class StepFailed(Exception):
    """A whole step failed (a hop is unreachable); its sequences' KV on the chain is lost."""

    def __init__(self, code: int, message: str, *, failed_address: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.failed_address = failed_address


class ChainScheduler:
    def __init__(
        self,
        send: StepSender,
        *,
        depth: int,
        token_budget: int = 512,
        share_prefixes: bool = True,
        on_step_failed: Callable[[list[Sequence], StepFailed], None],
        release: Callable[[list[str]], Awaitable[None]],
        on_failover_gap: Callable[[float], None] = lambda seconds: None,
        on_shared_prefix: Callable[[int], None] = lambda tokens: None,
    ) -> None:
        self.send = send
        self.depth = max(1, depth)
        self.token_budget = token_budget
        self.share_prefixes = share_prefixes
        self.on_step_failed = on_step_failed
        self.release = release
        self.on_failover_gap = on_failover_gap
        self.on_shared_prefix = on_shared_prefix
        self.sequences: dict[str, Sequence] = {}
        self.in_flight = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def load(self) -> int:
        return len(self.sequences)

    def add(self, seq: Sequence) -> None:
        self.sequences[seq.sequence_id] = seq
        self._wake.set()

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or cancelled sequence and free its KV on the chain.

        A sequence with a step still in flight is released when that step comes back, so the
        release cannot overtake the step on a later stage.
        """
        seq.done = True
        if self.sequences.pop(seq.sequence_id, None) is not None:
            self._release_if_idle(seq)
        self._wake.set()

    def _release_if_idle(self, seq: Sequence) -> None:
        """Free a finished sequence's KV once no step in flight runs it or copies from it."""
        if seq.done and seq.sequence_id not in self.sequences and not seq.in_flight and not seq.lent:
            asyncio.get_running_loop().create_task(self.release([seq.sequence_id]))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            while self.in_flight < self.depth and (step := self._plan()) is not None:
                self.in_flight += 1
                for s in step.slices:
                    s.seq.in_flight = True
                    if s.prefix_from is not None:
                        s.prefix_from.lent += 1
                        self.on_shared_prefix(s.start)
                asyncio.get_running_loop().create_task(self._dispatch(step))
            self._wake.clear()
            await self._wake.wait()

    def _plan(self) -> PlannedStep | None:
        ready = [s for s in self.sequences.values() if not s.in_flight and not s.done]
        if not ready:
            return None
        per_step = math.ceil(len(self.sequences) / self.depth)  # spread over the micro-batches
        budget = self.token_budget
        slices: list[Slice] = []
        decoding = [s for s in ready if len(s.history) - s.fed == 1]
        prefilling = [s for s in ready if len(s.history) - s.fed > 1]
        for seq in decoding + prefilling:
            if len(slices) == per_step or budget == 0:
                break
            history = seq.history
            start, donor = seq.fed, None
            if start == 0 and self.share_prefixes:
                donor, start = self._prefix_donor(seq)
            n = min(len(history) - start, budget)
            budget -= n
            end = start + n
            slices.append(Slice(seq, start, tuple(history[start:end]), sample=end == len(history), prefix_from=donor))
        return PlannedStep(tuple(slices)) if slices else None

    def _prefix_donor(self, seq: Sequence) -> tuple[Sequence | None, int]:
        """The live sequence on this chain whose KV holds the longest prefix of `seq`'s history.

        Only tokens whose step came back count (`fed`), so every stage holds them; steps reach
        each stage in order, so the copy runs after them. At least the last token is left to
        compute, since the step must yield its hidden state (and, at the end, a sampled token).
        """
        history = seq.history
        best, length = None, MIN_SHARED_PREFIX - 1
        for other in self.sequences.values():
            if other is seq or other.done or other.fed <= length or other.prompt[0] != history[0]:
                continue
            n = _common_prefix(history, other.history, min(other.fed, len(history) - 1))
            if n > length:
                best, length = other, n
        return (best, length) if best is not None else (None, 0)

    async def _dispatch(self, step: PlannedStep) -> None:
        try:
            outcomes = await self.send(step)
        except StepFailed as err:
            mine = [s.seq for s in step.slices if self._owns(s.seq)]
            for seq in mine:
                seq.in_flight = False
            self.on_step_failed(mine, err)
        else:
            by_id = {o.sequence_id: o for o in outcomes}
            for s in step.slices:
                if self._owns(s.seq):  # a sequence moved to another chain meanwhile is not ours
                    self._apply(s, by_id.get(s.seq.sequence_id))
        finally:
            for s in step.slices:
                if s.seq.done:
                    s.seq.in_flight = False  # finished meanwhile: its outcome was not applied
                self._release_if_idle(s.seq)
                if s.prefix_from is not None:
                    s.prefix_from.lent -= 1
                    self._release_if_idle(s.prefix_from)
            self.in_flight -= 1
            self._wake.set()

    def _owns(self, seq: Sequence) -> bool:
        return self.sequences.get(seq.sequence_id) is seq

    def _apply(self, s: Slice, outcome: Outcome | None) -> None:
        seq = s.seq
        seq.in_flight = False
        if seq.done:
            return
        if outcome is None:
            seq.on_error(13, f"the chain returned no result for sequence {seq.sequence_id}")
            return
        if outcome.error_code:
            seq.on_error(outcome.error_code, outcome.error_message)
            return
        seq.fed = s.start + len(s.token_ids)
        if s.sample:
            if outcome.token_id is None:
                seq.on_error(13, f"the chain sampled no token for sequence {seq.sequence_id}")
                return
            seq.generated.append(outcome.token_id)
            if seq.failed_at is not None:  # the first token after a failover
                self.on_failover_gap(time.monotonic() - seq.failed_at)
                seq.failed_at = None
            seq.on_token(outcome.token_id, outcome.logprob, list(outcome.top))


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens `a` and `b` share, at most `limit` (slices compare in C)."""
    limit = min(limit, len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    lo, hi = 0, limit  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
