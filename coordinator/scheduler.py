"""Continuous batching with several micro-batches in flight per chain.

Owns, for one chain, which live sequences advance in each step: decode tokens first, then
chunks of prompts under a per-step token budget, so a long prompt never stalls the decoding of
others. Up to `depth` micro-batches are in flight at once (default: the chain's length), each
with different sequences, so every stage has work while the others compute. Sequences join
and leave between steps.

A new sequence whose first tokens another already computed copies their KV at every stage
instead of computing them. Lenders are the live sequences of the chain and a cache of finished
ones: a sequence that ended normally keeps its KV on the chain (least recently used first out)
while the cache holds fewer tokens than its budget, a share of the chain's KV memory, so a
second request with the same system prompt, or the next turn of a chat, starts from it. A
cached sequence whose tokens all start a newer one's (the turn before, in a chat) gives way to it.

Knows nothing of text, of gRPC or of the wire: it hands `PlannedStep`s to a `StepSender` and
gets `Outcome`s back.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from layerline.shared.errors import Code
from layerline.shared.sampling import SamplingParams

log = logging.getLogger(__name__)

# A new sequence whose first tokens equal this many or more of a live or cached sequence's on the
# same chain (a shared system prompt, the same question twice) copies their KV instead of computing it.
MIN_SHARED_PREFIX = 4


@dataclass
class Sequence:
    """A sequence's token history (the ground truth its KV can be rebuilt from) and progress."""

    sequence_id: str
    prompt: list[int]
    sampling: SamplingParams
    on_token: Callable[[int, float | None, list[tuple[int, float]]], None]  # called per new token
    on_error: Callable[[Code, str], None]  # (status, message)
    generated: list[int] = field(default_factory=list)
    fed: int = 0  # tokens of the history whose KV the chain holds
    in_flight: bool = False
    lent: int = 0  # steps in flight that copy a prefix of its KV: it is released after them
    done: bool = False
    complete: bool = False  # ended normally (a stop or its length), not cancelled or failed
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
    release: tuple[str, ...] = ()  # cached sequences each stage frees before this step's work
    alone: bool = False  # no other step of the chain is in flight: a large one may take more cores


@dataclass(frozen=True)
class Outcome:
    """What came back for one sequence of a step."""

    sequence_id: str
    token_id: int | None = None
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    error_code: Code = Code.OK
    error_message: str = ""


class StepSender(Protocol):
    def __call__(self, step: PlannedStep) -> Awaitable[list[Outcome]]: ...


class StepFailed(Exception):
    """A whole step failed (a hop is unreachable); its sequences' KV on the chain is lost."""

    def __init__(self, code: int, message: str, *, failed_address: str = "") -> None:
        super().__init__(message)
        self.code = Code.of(code)
        self.failed_address = failed_address


class ChainScheduler:
    def __init__(
        self,
        send: StepSender,
        *,
        depth: int,
        token_budget: int = 512,
        share_prefixes: bool = True,
        cache_tokens: int = 0,
        block_size: int = 1,
        kv_blocks: int | None = None,
        on_step_failed: Callable[[list[Sequence], StepFailed], None],
        release: Callable[[list[str]], Coroutine[Any, Any, None]],
        on_failover_gap: Callable[[float], None] = lambda seconds: None,
        on_shared_prefix: Callable[[int], None] = lambda tokens: None,
    ) -> None:
        self.send = send
        self.depth = max(1, depth)
        self.token_budget = token_budget
        self.share_prefixes = share_prefixes
        # Finished sequences whose KV stays on the chain as lenders, least recently used first;
        # they hold at most `cache_tokens` positions, each rounded up to whole KV blocks.
        self.cache_tokens = cache_tokens if share_prefixes else 0
        self.block_size = max(1, block_size)
        self.kv_blocks = kv_blocks  # blocks of `block_size` on the chain's smallest stage; None: unknown
        self.cached: OrderedDict[str, Sequence] = OrderedDict()
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

    @property
    def cached_tokens(self) -> int:
        """KV positions the cache of finished sequences holds on each stage of the chain."""
        return sum(s.fed for s in self.cached.values())

    def cached_blocks(self, block_size: int) -> int:
        """KV blocks of `block_size` tokens the cache holds on one stage."""
        return sum(_blocks(s.fed, block_size) for s in self.cached.values())

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
        """Cache or free a finished sequence's KV once no step in flight runs it or copies from it."""
        if not seq.done or seq.sequence_id in self.sequences or seq.in_flight or seq.lent:
            return
        if seq.sequence_id in self.cached:
            self._evict()  # it may have stayed past the budget while lent
        elif seq.complete and seq.fed >= MIN_SHARED_PREFIX and self._blocks(seq) <= self._cache_blocks:
            self._free(self._covered_by(seq))  # the last turn of a chat covers the turns before it
            self.cached[seq.sequence_id] = seq
            self._evict()
        else:
            self._free([seq])

    def _covered_by(self, seq: Sequence) -> list[Sequence]:
        """Take out the cached sequences (not lent) whose computed tokens start `seq`'s: any
        prompt copies at least as much from `seq`."""
        history = seq.history
        out = [
            other
            for other in self.cached.values()
            if not other.lent and other.fed <= seq.fed and other.history[: other.fed] == history[: other.fed]
        ]
        for other in out:
            del self.cached[other.sequence_id]
        return out

    @property
    def _cache_blocks(self) -> int:
        return self.cache_tokens // self.block_size

    def _blocks(self, seq: Sequence) -> int:
        return _blocks(seq.fed, self.block_size)

    def _evict(self) -> None:
        """Free the least recently used cached sequences (not lent) until the cache fits its budget."""
        self._free(self._evicted(self._cache_blocks))

    def _evicted(self, limit: int, *, keep: Collection[str] = ()) -> list[Sequence]:
        """Take cached sequences out, least recently used first, until they hold at most `limit`
        blocks; lent ones and those in `keep` stay."""
        over = self.cached_blocks(self.block_size) - limit
        out: list[Sequence] = []
        for seq in list(self.cached.values()):
            if over <= 0:
                break
            if not seq.lent and seq.sequence_id not in keep:
                del self.cached[seq.sequence_id]
                out.append(seq)
                over -= self._blocks(seq)
        return out

    def _room_for_cache(self) -> int:
        """Blocks the cache may hold beside what the live sequences need for their next tokens."""
        if self.kv_blocks is None:
            return self._cache_blocks
        live = sum(_blocks(len(s.history) + 1, self.block_size) for s in self.sequences.values())
        return max(0, min(self._cache_blocks, self.kv_blocks - live))

    def drop_cache(self) -> None:
        """Free the whole cache of finished sequences; a lent one goes when its copies are done."""
        for seq in self.cached.values():
            seq.complete = False  # not cached again when its last copy returns
        dropped = [s for s in self.cached.values() if not s.lent]
        self.cached.clear()
        self._free(dropped)

    def _free(self, seqs: list[Sequence]) -> None:
        if seqs:
            asyncio.get_running_loop().create_task(self.release([s.sequence_id for s in seqs]))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            while self.in_flight < self.depth and (step := self._plan()) is not None:
                if self.in_flight == 0:
                    step = replace(step, alone=True)
                self.in_flight += 1
                for s in step.slices:
                    s.seq.in_flight = True
                    if s.prefix_from is not None:
                        s.prefix_from.lent += 1
                        if s.prefix_from.sequence_id in self.cached:
                            self.cached.move_to_end(s.prefix_from.sequence_id)  # used: last out
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
        if not slices:
            return None
        # The live sequences come first: cached ones they need room from are freed by every
        # stage just before this step, in order with the steps (never the ones it copies from).
        donors = {s.prefix_from.sequence_id for s in slices if s.prefix_from is not None}
        evicted = self._evicted(self._room_for_cache(), keep=donors) if self.cached else []
        return PlannedStep(tuple(slices), release=tuple(s.sequence_id for s in evicted))

    def _prefix_donor(self, seq: Sequence) -> tuple[Sequence | None, int]:
        """The live or cached sequence on this chain whose KV holds the longest prefix of `seq`'s history.

        Only tokens whose step came back count (`fed`), so every stage holds them; steps reach
        each stage in order, so the copy runs after them. At least the last token is left to
        compute, since the step must yield its hidden state (and, at the end, a sampled token).
        """
        history = seq.history
        best, length = None, MIN_SHARED_PREFIX - 1
        for other in itertools.chain(self.sequences.values(), self.cached.values()):
            if other is seq or other.fed <= length or other.prompt[0] != history[0]:
                continue
            if other.done and other.sequence_id not in self.cached:  # about to be freed
                continue
            n = _common_prefix(history, other.history, min(other.fed, len(history) - 1))
            if n > length:
                best, length = other, n
        return (best, length) if best is not None else (None, 0)

    async def _dispatch(self, step: PlannedStep) -> None:
        try:
            outcomes = await self.send(step)
        except StepFailed as err:
            if step.release:  # the stages may not have seen the step that frees them
                asyncio.get_running_loop().create_task(self.release(list(step.release)))
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
            seq.on_error(Code.INTERNAL, f"the chain returned no result for sequence {seq.sequence_id}")
            return
        if outcome.error_code:
            if outcome.error_code == Code.RESOURCE_EXHAUSTED:  # a stage's KV is full: the cache gives way
                self.drop_cache()
            seq.on_error(outcome.error_code, outcome.error_message)
            return
        seq.fed = s.start + len(s.token_ids)
        if s.sample:
            if outcome.token_id is None:
                seq.on_error(Code.INTERNAL, f"the chain sampled no token for sequence {seq.sequence_id}")
                return
            seq.generated.append(outcome.token_id)
            if seq.failed_at is not None:  # the first token after a failover
                self.on_failover_gap(time.monotonic() - seq.failed_at)
                seq.failed_at = None
            seq.on_token(outcome.token_id, outcome.logprob, list(outcome.top))


def _blocks(tokens: int, block_size: int) -> int:
    """KV blocks that `tokens` positions take: the last one may be partly filled."""
    return -(-tokens // block_size)


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
