"""Continuous batching with several micro-batches in flight per chain, within the chain's KV.

Owns, for one chain, which live sequences advance in each step: decode tokens first, then
chunks of prompts under a per-step token budget, so a long prompt never stalls the decoding of
others. Up to `depth` micro-batches are in flight at once (default: the chain's length), each
with different sequences, so every stage has work while the others compute. Sequences join
and leave between steps.

It also keeps the ledger of the chain's KV: the blocks each sequence's KV takes on the smallest
stage once its steps return. A new sequence starts, oldest first, only when its whole history
fits beside what runs; a running sequence that needs a block when none is free takes it from
the prefix cache, then from the youngest running sequences, which are preempted: their KV is
freed (by the very step that needs the room, before its work on every stage) and they wait to
be recomputed from their token history, as vLLM does. A sequence that cannot fit the chain's
KV even alone fails with RESOURCE_EXHAUSTED naming both sizes.

A new sequence whose first tokens another already computed copies their KV at every stage
instead of computing them (`prefix_cache`).

Knows nothing of text, of gRPC or of the wire: it hands `PlannedStep`s to a `StepSender` and
gets `Outcome`s back.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

from layerline.shared.errors import Code

from .prefix_cache import PrefixCache, blocks, longest_prefix
from .step_plan import StepPlan
from .steps import Outcome, PlannedStep, Sequence, Slice, StepFailed, StepSender, Token

log = logging.getLogger(__name__)

MAX_KV_RETRIES = 5  # times a stage may refuse one sequence for KV before it fails


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
        lender_ttl: float | None = None,
        on_step_failed: Callable[[list[Sequence], StepFailed], None],
        release: Callable[[list[str]], Coroutine[Any, Any, None]],
        on_failover_gap: Callable[[Sequence, float], None] = lambda seq, seconds: None,
        on_shared_prefix: Callable[[int], None] = lambda tokens: None,
        on_prefix_query: Callable[[int], None] = lambda tokens: None,
        on_preempted: Callable[[Sequence], None] = lambda seq: None,
        on_speculated: Callable[[int, int], None] = lambda drafted, accepted: None,
    ) -> None:
        self.send = send
        self.depth = max(1, depth)
        self.token_budget = token_budget
        self.share_prefixes = share_prefixes
        self.block_size = max(1, block_size)
        # Finished sequences whose KV stays on the chain as lenders; at most `cache_tokens` positions.
        self.cached = PrefixCache(
            budget_blocks=(cache_tokens if share_prefixes else 0) // self.block_size, block_size=self.block_size
        )
        self.kv_blocks = kv_blocks  # blocks of `block_size` on the chain's smallest stage; None: unknown
        self.lender_ttl = lender_ttl  # a lender unused this long is freed before the stages would call it orphaned
        self.on_step_failed = on_step_failed
        self.release = release
        self.on_failover_gap = on_failover_gap
        self.on_shared_prefix = on_shared_prefix
        self.on_prefix_query = on_prefix_query  # a sequence starts: its tokens are looked up in the KV
        self.on_preempted = on_preempted
        self.on_speculated = on_speculated  # a step verified drafted tokens: (drafted, accepted)
        self.sequences: dict[str, Sequence] = {}
        self.held: dict[str, int] = {}  # KV name -> positions it takes on each stage, until freed
        self.in_flight = 0
        self.pending_releases: list[str] = []  # KV names the next step frees before its work
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._promised: Sequence | None = None  # a run-ahead step's sequence: the next step is it alone

    @property
    def load(self) -> int:
        return len(self.sequences)

    @property
    def waiting(self) -> int:
        """Live sequences that hold no KV on the chain: new, moved or preempted ones."""
        return sum(1 for s in self.sequences.values() if not s.kv_tokens)

    @property
    def cached_tokens(self) -> int:
        """KV positions the cache of finished sequences holds on each stage of the chain."""
        return self.cached.tokens

    def longest_prefix(self, seq: Sequence) -> int:
        """Tokens of `seq`'s history that a live or cached sequence of this chain holds in its KV."""
        if not self.share_prefixes:
            return 0
        lenders = [*(s for s in self.sequences.values() if not s.done), *self.cached.values()]
        return longest_prefix(seq, lenders)[1]

    def cached_blocks(self, block_size: int) -> int:
        """KV blocks of `block_size` tokens the cache holds on one stage."""
        return sum(blocks(s.fed, block_size) for s in self.cached.values())

    def held_blocks(self) -> int:
        return sum(blocks(n, self.block_size) for n in self.held.values())

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
            self._free(self.cached.evicted(self.cached.budget_blocks))  # it may have stayed past the budget while lent
        elif seq.kv_id in self.held and self.cached.fits(seq):
            self._free(self.cached.add(seq))
        else:
            self._free([seq])

    def drop_cache(self) -> None:
        """Free the whole cache of finished sequences; a lent one goes when its copies are done."""
        self._free(self.cached.clear())

    def _free(self, seqs: list[Sequence]) -> None:
        """Free KV out of band; the ledger counts it held until every stage said it is freed."""
        names = [s.kv_id for s in seqs if s.kv_id in self.held]
        if names:
            asyncio.get_running_loop().create_task(self._release_now(names))

    async def _release_now(self, names: list[str]) -> None:
        try:
            await self.release(names)
        finally:
            for name in names:
                self.held.pop(name, None)
            self._wake.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._stopped = True  # steps in flight finish; none follows them
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            if self.lender_ttl is not None and self.cached:
                self._free(self.cached.idle(self.lender_ttl))
            while (step := self._next()) is not None:
                asyncio.get_running_loop().create_task(self._dispatch(step))
            if self.pending_releases and not self.in_flight:  # no step to carry them: free them now
                names, self.pending_releases = self.pending_releases, []
                asyncio.get_running_loop().create_task(self._release_now(names))
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.lender_ttl if self.cached and self.lender_ttl else None)
            except asyncio.TimeoutError:
                pass

    def _next(self) -> PlannedStep | None:
        """The next step, counted in flight, while the chain has room for one (`depth`) and a
        sequence is ready for it; None otherwise."""
        if self._stopped or self.in_flight >= self.depth or (step := self._plan()) is None:
            return None
        if self.in_flight == 0:
            step = replace(step, alone=True, run_ahead=self._continues(step))
            # One micro-batch at a time: arrivals wait for the promised step (with more, they go at once)
            self._promised = step.slices[0].seq if step.run_ahead and self.depth == 1 else None
        self.in_flight += 1
        for s in step.slices:
            s.seq.in_flight = True
            if s.prefix_from is not None:
                s.prefix_from.lent += 1
                self.cached.used(s.prefix_from)
                self.on_shared_prefix(s.start)
        return step

    def _continues(self, step: PlannedStep) -> bool:
        """Whether the step after `step` will be the same, its one sequence fed the token it draws
        now: the chain's only live sequence, it samples with no penalty, drafts nothing and may go
        on. At depth 1 the scheduler then keeps its word (`_promised`): a sequence that arrives
        while `step` is out joins the step after the next, so the next finds the guess a first stage
        computed for it instead of dropping it. (Deeper, an arrival's step goes at once and drops
        the guess.) Batches are not run ahead: on 2 shared cores a batch's guess overlapped the
        coordinator's and clients' work for its tokens and gained nothing (docs/performance.md, issue
        21's thirty-fourth session)."""
        if len(step.slices) != 1 or len(self.sequences) != 1:
            return False
        s = step.slices[0]
        seq = s.seq
        if not s.sample or s.draft or seq.speculate or seq.sampling.repetition_penalty != 1.0:
            return False
        return seq.max_generated is None or len(seq.generated) + 1 < seq.max_generated

    def _kept_promise(self) -> Sequence | None:
        """The sequence the next step must hold alone, when a run-ahead step promised it and the
        promise can be kept; None otherwise (it ended, failed over, or has no KV to decode on:
        refused or preempted). At depth 1 nothing else is planned while that step is out."""
        promised, self._promised = self._promised, None
        if promised is None or not self._owns(promised) or promised.in_flight or promised.done:
            return None
        return promised if promised.kv_tokens and len(promised.history) - promised.fed == 1 else None

    def _plan(self) -> PlannedStep | None:
        ready = sorted((s for s in self.sequences.values() if not s.in_flight and not s.done), key=lambda s: s.arrival)
        promised = self._kept_promise()
        if not ready:
            return None
        plan = StepPlan(self, per_step=math.ceil(len(self.sequences) / self.depth))
        if promised is not None:
            plan.add_running(promised)
            return plan.step()
        decoding = [s for s in ready if s.kv_tokens and len(s.history) - s.fed == 1]
        prefilling = [s for s in ready if s.kv_tokens and len(s.history) - s.fed > 1]
        for seq in decoding + prefilling:
            if plan.full:
                break
            plan.add_running(seq)
        starting = True  # oldest first: one that does not fit holds back the younger ones
        for seq in (s for s in ready if not s.kv_tokens):
            if not plan.never_fits(seq) and starting and not plan.full:
                starting = plan.add_new(seq)
        return plan.step()

    async def _dispatch(self, step: PlannedStep) -> None:
        """Send `step` and apply what comes back; then, in this same task, send the step planned
        once it returned, and so on while there is one. Its header is written before the tasks
        that the last step's tokens woke (each request's client stream) run: a 32-stream step
        waited 2.4 ms (median) between its result's arrival and the next step's write when the
        next one was a task of its own, queued behind those streams."""
        following: PlannedStep | None = step
        while following is not None:
            await self._exchange(following)
            following = self._next()

    async def _exchange(self, step: PlannedStep) -> None:
        try:
            outcomes = await self.send(step)
        except StepFailed as err:
            if step.release:  # the stages may not have seen the step that frees them
                asyncio.get_running_loop().create_task(self.release(list(step.release)))
            mine = [s.seq for s in step.slices if self._owns(s.seq)]
            for seq in mine:
                seq.in_flight = False
            self.on_step_failed(mine, err)
        except Exception as err:  # a bug: the step's sequences fail, and nothing is left in flight
            log.exception("a step of %d sequence(s) could not be sent", len(step.slices))
            for s in step.slices:
                s.seq.in_flight = False
                if self._owns(s.seq):
                    s.seq.on_error(Code.INTERNAL, f"the step could not be sent: {err!r}")
        else:
            by_name = {o.sequence_id: o for o in outcomes}
            for s in step.slices:
                if self._owns(s.seq):  # a sequence moved to another chain meanwhile is not ours
                    self._apply(s, by_name.get(s.seq.kv_id))
        finally:
            self._returned(step)

    def _returned(self, step: PlannedStep) -> None:
        """A step came back, one way or another: its sequences and lenders may be freed now."""
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
        if outcome.error_code == Code.RESOURCE_EXHAUSTED:
            self._refused(seq, outcome.error_message)
            return
        if outcome.error_code:
            seq.on_error(outcome.error_code, outcome.error_message)
            return
        accepted = outcome.accepted
        if tuple(t.token_id for t in accepted) != s.draft[: len(accepted)]:
            seq.on_error(Code.INTERNAL, f"the chain accepted tokens it was not drafted for sequence {seq.sequence_id}")
            return
        seq.fed = s.start + len(s.token_ids) + len(accepted)
        if s.sample:
            if outcome.token_id is None:
                seq.on_error(Code.INTERNAL, f"the chain sampled no token for sequence {seq.sequence_id}")
                return
            if seq.failed_at is not None:  # the first token after a failover
                self.on_failover_gap(seq, time.monotonic() - seq.failed_at)
                seq.failed_at = None
            if s.draft:
                seq.lookup.verified(len(s.draft), len(accepted))
                self.on_speculated(len(s.draft), len(accepted))
            for token in (*accepted, Token(outcome.token_id, outcome.logprob, outcome.top)):
                seq.generated.append(token.token_id)
                seq.on_token(token.token_id, token.logprob, list(token.top))
                if seq.done:  # a stop or its length: the accepted tokens after it are not its
                    seq.fed = min(seq.fed, len(seq.history))
                    break

    def _refused(self, seq: Sequence, message: str) -> None:
        """A stage had no room for a sequence the ledger let through: it holds KV this scheduler
        does not know of (another coordinator's, until it is freed as orphaned). The cache gives
        way and the sequence waits, longer each time, to be recomputed; it fails past a bound."""
        self.drop_cache()
        seq.refusals += 1
        if seq.refusals > MAX_KV_RETRIES:
            seq.on_error(Code.RESOURCE_EXHAUSTED, f"{message} (refused {MAX_KV_RETRIES} times)")
            return
        log.warning("a stage refused sequence %s for KV (%s); it waits to be recomputed", seq.sequence_id, message)
        self.pending_releases.append(seq.replace_kv())
        delay = 0.1 * 2**seq.refusals
        seq.not_before = time.monotonic() + delay
        asyncio.get_running_loop().call_later(delay, self._wake.set)
        self.on_preempted(seq)
