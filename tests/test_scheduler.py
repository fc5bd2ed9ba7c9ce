"""The chain scheduler's prefix sharing: which steps copy a prefix, and when a lender is freed."""

from __future__ import annotations

import asyncio

from layerline.coordinator.scheduler import ChainScheduler, Outcome, PlannedStep, Sequence
from layerline.sampling import SamplingParams


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
        future.set_result([Outcome(s.seq.sequence_id, token_id=7 if s.sample else None) for s in step.slices])


def seq(name: str, prompt: list[int]) -> Sequence:
    return Sequence(name, prompt, SamplingParams(), on_token=lambda *a: None, on_error=lambda *a: None)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_new_prompt_copies_the_longest_computed_prefix_and_its_lender_waits_for_it():
    async def run() -> None:
        sender = HeldSteps()
        sched = ChainScheduler(sender, depth=8, on_step_failed=lambda *a: None, release=sender.release)
        sched.start()
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
        sched = ChainScheduler(sender, depth=2, share_prefixes=False, on_step_failed=lambda *a: None,
                               release=sender.release)
        sched.start()
        sched.add(seq("a", [1, 2, 3, 4, 5, 6]))
        await settle()
        sender.answer(0)
        await settle()
        sched.add(seq("b", [1, 2, 3, 4, 5, 6, 7]))
        await settle()
        assert [(s.start, s.prefix_from) for st, _ in sender.steps[1:] for s in st.slices
                if s.seq.sequence_id == "b"] == [(0, None)]
        await sched.stop()

    asyncio.run(run())
