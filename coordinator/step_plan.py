"""One step of a chain being planned within the chain's KV: what it runs, frees and takes.

Owns the arithmetic of the scheduler's KV ledger for one step: the blocks free on the chain's
smallest stage, a new sequence started only when its whole history (and its next token) fits,
room made for a running sequence from the prefix cache and then by preempting running
sequences younger than it (youngest first, and only when that makes enough room), and the KV
names the step frees before its work on every stage. A sequence that needs more KV than the
chain holds fails with RESOURCE_EXHAUSTED naming both sizes.

Knows nothing of the wire or of dispatch: the scheduler sends the `PlannedStep` it yields.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from layerline.shared.errors import Code

from .prefix_cache import blocks, longest_prefix
from .steps import PlannedStep, Sequence, Slice

if TYPE_CHECKING:
    from .scheduler import ChainScheduler

log = logging.getLogger(__name__)


class StepPlan:
    """One step being planned: its slices, the token budget left, and the KV it frees and takes."""

    def __init__(self, sched: ChainScheduler, *, per_step: int) -> None:
        self.sched = sched
        self.per_step = per_step
        self.budget = sched.token_budget
        self.slices: list[Slice] = []
        self.freed: dict[str, int] = {}  # KV names this step frees before its work, and their positions
        self.planned: set[str] = set()  # sequence ids in this step, as slices or lenders
        self.free: int | None = None if sched.kv_blocks is None else sched.kv_blocks - sched.held_blocks()
        for name in sched.pending_releases:
            self._forget(name)
        sched.pending_releases = []

    @property
    def full(self) -> bool:
        return len(self.slices) == self.per_step or self.budget == 0

    def _blocks(self, tokens: int) -> int:
        return blocks(tokens, self.sched.block_size)

    def _forget(self, name: str) -> None:
        tokens = self.sched.held.pop(name, None)
        if tokens is not None:
            self.freed[name] = tokens
            if self.free is not None:
                self.free += self._blocks(tokens)

    def add_running(self, seq: Sequence) -> None:
        end = seq.fed + min(len(seq.history) - seq.fed, self.budget)
        draft = self._draft(seq, end)
        if self._room(seq, self._blocks(end + len(draft)) - self._blocks(seq.kv_tokens)):
            self._take(seq, seq.fed, end, None, draft=draft)
        elif self._blocks(end) > (self.sched.kv_blocks or 0):
            self._too_big(seq, len(seq.history))

    def add_new(self, seq: Sequence) -> bool:
        """Start `seq` if its whole history (and its next token) fits beside what runs; False if not."""
        sched = self.sched
        if seq.not_before > time.monotonic():
            return True  # refused by a stage a moment ago: it waits, the next may start
        need = self._blocks(len(seq.history) + 1)
        donor, start = (None, 0)
        if sched.share_prefixes:
            lenders = [*sched.sequences.values(), *sched.cached.values()]
            donor, start = longest_prefix(seq, (o for o in lenders if not o.done or o.sequence_id in sched.cached))
        keep = {donor.sequence_id} if donor is not None else set()
        if self.free is not None and need > self.free:
            if need > self.free + self._evictable(keep):
                return False
            self._evict_cache(need, keep=keep)
        end = start + min(len(seq.history) - start, self.budget)
        self._take(seq, start, end, donor)
        if sched.share_prefixes:
            sched.on_prefix_query(len(seq.history))
        return True

    def _draft(self, seq: Sequence, end: int) -> tuple[int, ...]:
        """Tokens guessed by prompt lookup to follow a sequence whose whole history this step feeds:
        within its `speculate`, the step's token budget and the tokens it may still generate."""
        if not seq.speculate or end < len(seq.history):
            return ()
        k = min(seq.speculate, self.budget - (end - seq.fed))
        if seq.max_generated is not None:
            k = min(k, seq.max_generated - len(seq.generated) - 1)
        draft = tuple(seq.lookup.draft(seq.history, k))
        if self.free is not None and self._blocks(end + len(draft)) - self._blocks(seq.kv_tokens) > self.free:
            return ()  # a draft takes free KV only, never another sequence's
        return draft

    def never_fits(self, seq: Sequence) -> bool:
        """Fail `seq` if its history and next token need more KV than the chain's smallest stage holds."""
        if self.sched.kv_blocks is None or self._blocks(len(seq.history) + 1) <= self.sched.kv_blocks:
            return False
        self._too_big(seq, len(seq.history) + 1)
        return True

    def _too_big(self, seq: Sequence, positions: int) -> None:
        sched = self.sched
        seq.on_error(
            Code.RESOURCE_EXHAUSTED,
            f"sequence {seq.sequence_id} needs {self._blocks(positions)} KV blocks of {sched.block_size} tokens "
            f"for {positions} positions; the smallest stage of its chain holds {sched.kv_blocks} "
            "(raise --kv-memory on the stages, or ask for fewer tokens)",
        )

    def _evictable(self, keep: set[str]) -> int:
        return sum(
            self._blocks(s.fed)
            for s in self.sched.cached.values()
            if not s.lent and s.sequence_id not in keep and s.sequence_id not in self.planned
        )

    def _room(self, seq: Sequence, need: int) -> bool:
        """Make `need` blocks free for `seq`: from the cache, then by preempting running sequences
        younger than it, youngest first; nothing is taken unless that makes enough room."""
        if self.free is None or need <= self.free:
            return True
        victims = sorted(
            (
                s
                for s in self.sched.sequences.values()
                if s.kv_tokens
                and s.arrival > seq.arrival
                and not s.in_flight
                and not s.lent
                and s.sequence_id not in self.planned
            ),
            key=lambda s: s.arrival,
            reverse=True,
        )
        if need > self.free + self._evictable(set()) + sum(self._blocks(v.kv_tokens) for v in victims):
            return False
        self._evict_cache(need, keep=set())
        for victim in victims:
            if need <= self.free:
                break
            self._preempt(victim)
        return True

    def _evict_cache(self, need: int, *, keep: set[str]) -> None:
        assert self.free is not None
        cache = self.sched.cached
        short = need - self.free
        if short > 0:
            for seq in cache.evicted(max(0, cache.held_blocks() - short), keep=keep | self.planned):
                self._forget(seq.kv_id)

    def _preempt(self, victim: Sequence) -> None:
        log.info("preempting sequence %s (%d positions) for an older one's KV", victim.sequence_id, victim.kv_tokens)
        victim.preemptions += 1
        self._forget(victim.replace_kv())
        self.sched.on_preempted(victim)

    def _take(
        self, seq: Sequence, start: int, end: int, donor: Sequence | None, *, draft: tuple[int, ...] = ()
    ) -> None:
        history = seq.history
        held = end + len(draft)  # the stages hold the drafted tokens' KV until a later step rewinds it
        rewind = seq.kv_tokens > start  # they hold KV of drafted tokens that were rejected
        self.budget -= held - start
        if self.free is not None:
            self.free -= self._blocks(held) - self._blocks(seq.kv_tokens)
        seq.kv_tokens = held
        self.sched.held[seq.kv_id] = held
        self.planned.add(seq.sequence_id)
        if donor is not None:
            self.planned.add(donor.sequence_id)
        self.slices.append(
            Slice(
                seq,
                start,
                tuple(history[start:end]),
                sample=end == len(history),
                prefix_from=donor,
                draft=draft,
                rewind=rewind,
            )
        )

    def step(self) -> PlannedStep | None:
        if not self.slices:  # nothing runs: what it would have freed waits for the next step
            self.sched.held.update(self.freed)
            self.sched.pending_releases.extend(self.freed)
            return None
        return PlannedStep(tuple(self.slices), release=tuple(self.freed))
