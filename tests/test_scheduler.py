"""The chain scheduler's prefix sharing: which steps copy a prefix, and when a lender is freed."""

from __future__ import annotations

import asyncio

from layerline.coordinator.scheduler import ChainScheduler, Outcome, PlannedStep, Sequence
from layerline.shared.sampling import SamplingParams


class HeldSteps:
    """A StepSender whose steps wait until the test answers them, one token each."""

    def __init__(self) -> None:
        self.steps: list[tuple[PlannedStep, asyncio.Future[list[Outcome]]]] = []
        self.released: list[str] = []

    async def __call__(self, step: PlannedStep) -> list[Outcome]:
        future: asyncio.Future[list[Outcome]] = asyncio.get_running_loop().create_future()
        self.steps.append((step, future))
        return await future

    async def release(self, ids: list[str]) -> None:
        self.released += ids

    def answer(self, i: int) -> None:
        step, future = self.steps[i]
        future.set_result([Outcome(s.seq.kv_id, token_id=7 if s.sample else None) for s in step.slices])


def seq(name: str, prompt: list[int]) -> Sequence:
    return Sequence(name, prompt, SamplingParams(), on_token=lambda *a: None, on_error=lambda *a: None)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def started(sender: HeldSteps, **kwargs: object) -> ChainScheduler:
    """A running scheduler that sends to `sender` and releases through it."""
    sched = ChainScheduler(sender, on_step_failed=lambda *a: None, release=sender.release, **kwargs)  # type: ignore[arg-type]
    sched.start()
    return sched


def test_a_new_prompt_copies_the_longest_computed_prefix_and_its_lender_waits_for_it():
    async def run() -> None:
        sender = HeldSteps()
        sched = started(sender, depth=8)
        a = seq("a", [1, 2, 3, 4, 5, 6, 7, 8])
        sched.add(a)
        await settle()
        assert [s.prefix_from for s in sender.steps[0][0].slices] == [None]  # nothing to share yet
        early = seq("early", [1, 2, 3, 4, 5, 6, 9])
        sched.add(early)  # a's prompt is in flight, not yet computed: computed in full
        await settle()
        assert [(s.start, s.prefix_from) for s in sender.steps[1][0].slices] == [(0, None)]
        sender.answer(0)  # a's prompt is now in the chain's KV; a decodes in step 2
        await settle()
        b = seq("b", [1, 2, 3, 4, 5, 6, 9, 9, 9])
        short = seq("short", [1, 2, 3, 9])  # 3 tokens in common: below the minimum
        same = seq("same", [1, 2, 3, 4, 5, 6, 7, 8])  # the last token is always computed
        for s in (b, short, same):
            sched.add(s)
        await settle()
        planned = {s.seq.sequence_id: (s.start, s.prefix_from) for st, _ in sender.steps[3:] for s in st.slices}
        assert planned == {"b": (6, a), "short": (0, None), "same": (7, a)}
        assert a.lent == 2
        sched.finish(a)  # a ends while its own step and two that copy from it are in flight
        sender.answer(2)
        await settle()
        assert sender.released == []  # still lent
        sender.answer(3)
        await settle()
        assert sender.released == [] and a.lent == 1
        sender.answer(5)
        await settle()
        assert sender.released == ["a"] and a.lent == 0
        await sched.stop()

    asyncio.run(run())


def test_sharing_can_be_turned_off():
    async def run() -> None:
        sender = HeldSteps()
        sched = started(sender, depth=2, share_prefixes=False)
        sched.add(seq("a", [1, 2, 3, 4, 5, 6]))
        await settle()
        sender.answer(0)
        await settle()
        sched.add(seq("b", [1, 2, 3, 4, 5, 6, 7]))
        await settle()
        assert [
            (s.start, s.prefix_from) for st, _ in sender.steps[1:] for s in st.slices if s.seq.sequence_id == "b"
        ] == [(0, None)]
        await sched.stop()

    asyncio.run(run())


def ending(name: str, prompt: list[int], tokens: int) -> Sequence:
    """A sequence that ends normally after `tokens` generated tokens, as a request's generation does."""
    s = seq(name, prompt)

    def on_token(*_: object) -> None:
        if len(s.generated) == tokens:
            s.done = s.complete = True

    s.on_token = on_token
    return s


async def run_to_end(sched: ChainScheduler, sender: HeldSteps, s: Sequence) -> None:
    """Add `s`, answer its steps until it ends, and hand it back as the cluster does."""
    sched.add(s)
    await settle()
    while not s.done:
        sender.answer(-1)
        await settle()
    sched.finish(s)
    await settle()


def test_a_finished_sequence_stays_as_a_lender_until_the_cache_needs_its_room():
    async def run() -> None:
        sender = HeldSteps()
        # 16 tokens of cache in blocks of 4: two sequences of 6 computed tokens (2 blocks each)
        sched = started(sender, depth=1, cache_tokens=16, block_size=4)
        a = ending("a", [1, 2, 3, 4, 5], tokens=2)  # KV of its 5 prompt tokens and its first token
        await run_to_end(sched, sender, a)
        assert sender.released == [] and list(sched.cached) == ["a"]
        assert (sched.cached_tokens, sched.cached_blocks(4), sched.cached_blocks(16)) == (6, 2, 1)
        b = ending("b", [1, 2, 3, 4, 5, 9, 9, 9], tokens=1)  # a's prompt, then its own
        await run_to_end(sched, sender, b)
        assert [(s.start, s.prefix_from) for s in sender.steps[-1][0].slices] == [(5, a)]  # its one step
        assert list(sched.cached) == ["a", "b"] and sender.released == []  # 2 + 2 blocks: full
        c = ending("c", [8, 8, 8, 8, 8, 8], tokens=1)
        await run_to_end(sched, sender, c)
        assert list(sched.cached) == ["b", "c"] and sender.released == ["a"]  # least recently used out
        await sched.stop()

    asyncio.run(run())


def test_only_sequences_that_ended_normally_are_cached_and_a_lent_one_is_freed_after_its_copy():
    async def run() -> None:
        sender = HeldSteps()
        sched = started(sender, depth=2, cache_tokens=8, block_size=4)
        cancelled = seq("cancelled", [1, 2, 3, 4, 5, 6])
        sched.add(cancelled)
        await settle()
        sender.answer(0)
        await settle()
        sched.finish(cancelled)  # the client went away: its decode step is in flight
        sender.answer(1)
        await settle()
        assert sender.released == ["cancelled"] and not sched.cached
        a = ending("a", [1, 2, 3, 4, 5, 6], tokens=1)
        await run_to_end(sched, sender, a)
        assert list(sched.cached) == ["a"]
        b = seq("b", [1, 2, 3, 4, 5, 6, 7])
        sched.add(b)
        await settle()
        copying = len(sender.steps) - 1
        assert [(s.start, s.prefix_from) for s in sender.steps[copying][0].slices] == [(6, a)]
        c = ending("c", [9, 9, 9, 9, 9, 9, 9], tokens=1)  # 2 more blocks, past the budget: a is lent,
        await run_to_end(sched, sender, c)  # so c goes instead
        assert list(sched.cached) == ["a"] and sender.released == ["cancelled", "c"]
        sched.drop_cache()  # as when a stage's KV is full: a leaves the cache, freed once b's copy is done
        await settle()
        assert not sched.cached and sender.released == ["cancelled", "c"] and a.lent == 1
        sender.answer(copying)
        await settle()
        assert not sched.cached and sender.released == ["cancelled", "c", "a"]
        await sched.stop()

    asyncio.run(run())


def test_a_stage_that_refuses_kv_empties_the_prefix_cache_and_the_sequence_is_recomputed_under_a_new_name():
    async def run() -> None:
        sender = HeldSteps()
        sched = started(sender, depth=1, cache_tokens=64, block_size=4)
        for name, first in (("a", 1), ("b", 2)):
            await run_to_end(sched, sender, ending(name, [first] * 6, tokens=1))
        assert list(sched.cached) == ["a", "b"]
        errors: list[tuple[int, str]] = []
        big = Sequence("big", [5] * 40, SamplingParams(), on_token=lambda *a: None, on_error=lambda *e: None)

        def on_error(*error: object) -> None:  # as a request's generation ends
            errors.append(error)  # type: ignore[arg-type]
            big.done = True

        big.on_error = on_error
        sched.add(big)
        await settle()
        for attempt in range(6):  # a stage that holds KV the ledger does not know of refuses it again and again
            step, future = sender.steps[-1]
            assert [(s.seq.kv_id, s.start) for s in step.slices] == [("big" + (f".{attempt}" if attempt else ""), 0)]
            future.set_result([Outcome(big.kv_id, error_code=8, error_message="KV cache full")])
            await settle()
            if attempt == 0:
                assert errors == [] and not sched.cached and sorted(sender.released) == ["a", "b", "big"]
            if attempt < 5:
                await asyncio.sleep(0.1 * 2 ** (attempt + 1) + 0.05)  # it waits longer each time
                await settle()
        assert errors == [(8, "KV cache full (refused 5 times)")]
        sched.finish(big)  # as the request's end does
        await settle()
        assert sender.released[-1] == "big.5" and not sched.held
        await sched.stop()

    asyncio.run(run())


def test_no_cache_without_sharing_or_budget():
    async def run() -> None:
        for kwargs in (dict(share_prefixes=False, cache_tokens=64), dict(cache_tokens=0)):
            sender = HeldSteps()
            sched = started(sender, depth=1, block_size=4, **kwargs)
            await run_to_end(sched, sender, ending("a", [1] * 6, tokens=1))
            assert sender.released == ["a"] and not sched.cached
            await sched.stop()

    asyncio.run(run())


def test_live_sequences_take_the_caches_room_and_the_step_itself_frees_it():
    async def run() -> None:
        sender = HeldSteps()
        # 10 blocks of 4 tokens on the smallest stage, half of them for the cache
        sched = started(sender, depth=1, cache_tokens=20, block_size=4, kv_blocks=10)
        for name, first in (("a", 1), ("b", 2)):
            await run_to_end(sched, sender, ending(name, [first] * 8, tokens=1))  # 8 tokens: 2 blocks each
        assert list(sched.cached) == ["a", "b"]
        big = seq("big", [2] * 8 + [5] * 16)  # 25 tokens with its next one: 7 blocks, 3 left for the cache
        sched.add(big)
        await settle()
        step = sender.steps[-1][0]
        assert [(s.start, s.prefix_from) for s in step.slices] == [(8, sched.cached["b"])]
        assert step.release == ("a",)  # b lends to this very step, so a goes, ordered before it
        assert list(sched.cached) == ["b"] and sender.released == []
        await sched.stop()

    asyncio.run(run())


def test_the_next_turn_of_a_chat_replaces_the_turn_before_in_the_cache():
    async def run() -> None:
        sender = HeldSteps()
        sched = started(sender, depth=1, cache_tokens=64, block_size=4)
        first = ending("first", [1, 2, 3, 4, 5], tokens=2)  # history 1 2 3 4 5 7 7; KV of 6 tokens
        await run_to_end(sched, sender, first)
        other = ending("other", [1, 2, 3, 4, 9, 9], tokens=1)  # shares 4 tokens only: both stay
        await run_to_end(sched, sender, other)
        assert list(sched.cached) == ["first", "other"]
        second = ending("second", [1, 2, 3, 4, 5, 7, 7, 8, 8], tokens=1)  # the conversation so far, and more
        await run_to_end(sched, sender, second)
        assert [(s.start, s.prefix_from) for s in sender.steps[-1][0].slices] == [(6, first)]  # its one step
        assert list(sched.cached) == ["other", "second"] and sender.released == ["first"]
        await sched.stop()

    asyncio.run(run())


def test_only_a_step_sent_while_no_other_is_in_flight_is_marked_alone():
    async def run() -> None:
        sender = HeldSteps()
        sched = started(sender, depth=2)
        sched.add(seq("a", [1, 2, 3]))
        await settle()
        sched.add(seq("b", [4, 5, 6]))
        await settle()
        sender.answer(0)
        await settle()
        sender.answer(1)
        await settle()
        assert [step.alone for step, _ in sender.steps] == [True, False, False, False]
        await sched.stop()

    asyncio.run(run())


def test_a_running_sequence_short_of_kv_preempts_the_youngest_which_is_recomputed_from_its_history():
    async def run() -> None:
        sender = HeldSteps()
        # 4 blocks of 2 tokens: a (oldest) and b fill them with their prompts and first token
        sched = started(sender, depth=1, block_size=2, kv_blocks=4, share_prefixes=False)
        a, b = seq("a", [1, 2, 3]), seq("b", [4, 5, 6])
        sched.add(a)
        sched.add(b)
        await settle()
        assert [(s.seq.kv_id, s.start) for s in sender.steps[0][0].slices] == [("a", 0), ("b", 0)]
        sender.answer(0)
        await settle()
        assert sched.held == {"a": 4, "b": 4}  # position 3 of each is in flight: 2 blocks each, all of them
        sender.answer(1)
        await settle()
        a_decodes = sender.steps[-1][0]
        assert [(s.seq.kv_id, s.start) for s in a_decodes.slices] == [("a", 4)]  # b gave way, in this very step
        assert a_decodes.release == ("b",) and b.kv_id == "b.1" and b.preemptions == 1 and b.fed == 0
        assert b.generated == [7, 7]  # its tokens stay: they are recomputed, not drawn again
        sched.finish(a)
        sender.answer(-1)
        await settle()
        recompute = sender.steps[-1][0]
        assert [(s.seq.kv_id, s.start, s.token_ids) for s in recompute.slices] == [("b.1", 0, (4, 5, 6, 7, 7))]
        await sched.stop()

    asyncio.run(run())


def test_a_new_sequence_waits_until_its_whole_history_fits_and_one_that_never_can_fails():
    async def run() -> None:
        sender = HeldSteps()
        sched = started(sender, depth=2, block_size=4, kv_blocks=4, share_prefixes=False)
        errors: list[tuple[int, str]] = []
        first, second = seq("first", [1] * 10), seq("second", [2] * 6)  # 3 and 2 blocks with the next token
        huge = seq("huge", [3] * 16)  # 5 blocks: more than the chain holds

        def on_error(*error: object) -> None:  # as a request's generation ends
            errors.append(error)  # type: ignore[arg-type]
            huge.done = True

        huge.on_error = on_error
        for s in (first, second, huge):
            sched.add(s)
        await settle()
        assert [s.seq.kv_id for st, _ in sender.steps for s in st.slices] == ["first"]  # second waits: no preemption
        assert errors == [
            (
                8,
                "sequence huge needs 5 KV blocks of 4 tokens for 17 positions; the smallest stage of "
                "its chain holds 4 (raise --kv-memory on the stages, or ask for fewer tokens)",
            )
        ]
        sched.finish(first)
        sched.finish(huge)
        sender.answer(0)
        await settle()
        assert sender.released == ["first"]
        assert [s.seq.kv_id for s in sender.steps[-1][0].slices] == ["second"]
        await sched.stop()

    asyncio.run(run())


def test_the_next_step_goes_out_from_the_returning_step_before_anything_else_runs_and_none_after_stop():
    """A step's result and the next step's send happen in one go: no other task runs between them
    (a client stream woken by the tokens waits until the next step is sent). A stopped scheduler
    lets the step in flight finish and sends none after it."""

    async def run() -> None:
        sender = HeldSteps()
        sched = started(sender, depth=1)
        order: list[str] = []
        sched.add(Sequence("a", [1, 2], SamplingParams(), on_token=lambda *_: order.append("token"), on_error=print))
        await settle()
        assert len(sender.steps) == 1

        async def woken_by_the_token() -> None:  # as a client stream is, once its token is queued
            await asyncio.sleep(0)
            order.append("woken")

        def answer_then_wake() -> None:
            sender.answer(0)
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(woken_by_the_token()))

        answer_then_wake()
        await asyncio.sleep(0)  # the returning step resumes first; the wake-up is queued behind it
        await asyncio.sleep(0)
        assert len(sender.steps) == 2 and order[:1] == ["token"] and "woken" not in order
        await settle()
        assert order == ["token", "woken"]
        await sched.stop()
        sender.answer(1)
        await settle()
        assert len(sender.steps) == 2  # the step in flight finished; none followed it

    asyncio.run(run())
