"""A first stage runs the next decode step ahead as a guess (run_ahead.py, compute.py).

On a real StageEngine of a tiny model, driven through StageCompute as the stage's streams drive it:
a guessed step that the next header matches gives that step's output, a different step drops the
guess's KV before it runs, and the tokens are those of a stage that never guesses. The scheduler's
side: which steps it marks `run_ahead`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
import torch

from layerline.coordinator.scheduler import ChainScheduler, PlannedStep
from layerline.coordinator.scheduler import Sequence as SchedSequence
from layerline.coordinator.steps import Outcome, StepFailed
from layerline.protos.v1 import stage_pb2
from layerline.shared.errors import Code
from layerline.shared.model_config import LayerRange
from layerline.shared.sampling import SamplingParams
from layerline.stage_worker.compute import StageCompute
from layerline.stage_worker.engine import SequenceStep, StageEngine, StepOutput
from layerline.stage_worker.frames import ReceivedStep
from layerline.stage_worker.run_ahead import guess
from layerline.stage_worker.sampler import Draw
from layerline.stage_worker.step_telemetry import StepClock

from .test_engine import engine
from .test_scheduler import HeldSteps, seq, settle, started
from .tiny_models import make_tiny_checkpoint

PROMPT = (1, 17, 42, 99, 3, 5, 8)
SAMPLED = SamplingParams(temperature=0.8, seed=5)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("run_ahead")
    make_tiny_checkpoint("smollm2", path)
    return path


def received(seqs: Sequence[SequenceStep], *, run_ahead: bool = True, release: Sequence[str] = ()) -> ReceivedStep:
    header = stage_pb2.StepHeader(step_id=1, run_ahead=run_ahead, alone=True, release_sequence_ids=release)
    return ReceivedStep(header=header, seqs=list(seqs), times=StepClock())


def settled(compute: StageCompute) -> None:
    """Wait for what the compute thread runs now, a guess included, without dropping it."""
    compute.executor.submit(lambda: None).result()


def decode(compute: StageCompute, sampling: SamplingParams, n: int, *, run_ahead: bool = True) -> list[int]:
    """A lone stream of `n` tokens through `compute`, each step sent once the one before answered."""

    async def run() -> list[int]:
        tokens: list[int] = []
        step = SequenceStep("a", tuple(range(len(PROMPT))), PROMPT, sampling=sampling)
        for _ in range(n):
            out = await compute.start(received([step], run_ahead=run_ahead), chain="c")
            assert not out.errors
            tokens.append(out.draws["a"].token_id)
            step = SequenceStep("a", (step.positions[-1] + 1,), (tokens[-1],), sampling=sampling)
        return tokens

    try:
        return asyncio.run(run())
    finally:
        settled(compute)


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SAMPLED], ids=["greedy", "seeded"])
def test_a_lone_stream_run_ahead_draws_the_tokens_of_a_stage_that_waits(ckpt, sampling):
    n = 12
    waits = StageCompute(engine(ckpt, LayerRange(0, 4)), run_ahead=False)
    expected = decode(waits, sampling, n)
    ahead_engine = engine(ckpt, LayerRange(0, 4))
    ahead = StageCompute(ahead_engine, run_ahead=True)
    assert decode(ahead, sampling, n) == expected
    assert ahead.guesses == {"used": n - 1, "dropped": 0}  # every step after the prompt's was ready
    assert ahead_engine.steps_computed == n + 1  # and one more is guessed past the last
    assert waits.engine.steps_computed == n and waits.guesses == {"used": 0, "dropped": 0}
    assert ahead_engine.cache.length("a") == len(PROMPT) + n  # the last guess wrote one position more
    assert decode(StageCompute(engine(ckpt, LayerRange(0, 4)), run_ahead=True), sampling, n, run_ahead=False) == (
        expected
    )


def test_a_different_step_drops_the_guess_and_its_kv_before_it_runs(ckpt):
    async def run(eng: StageEngine, *, ahead: bool) -> tuple[StepOutput, StageCompute]:
        compute = StageCompute(eng, run_ahead=ahead)
        prompt = SequenceStep("a", tuple(range(len(PROMPT))), PROMPT, sampling=SAMPLED)
        first = await compute.start(received([prompt]), chain="c")
        settled(compute)  # the guess ran: the KV holds one position more
        assert eng.cache.length("a") == len(PROMPT) + (1 if ahead else 0)
        other = 1 + first.draws["a"].token_id % 100  # not the token drawn: not the guessed step
        step = received([SequenceStep("a", (len(PROMPT),), (other,), sampling=SAMPLED)])
        return await compute.start(step, chain="c"), compute

    plain, _ = asyncio.run(run(engine(ckpt, LayerRange(0, 4)), ahead=False))
    eng = engine(ckpt, LayerRange(0, 4))
    out, compute = asyncio.run(run(eng, ahead=True))
    assert out.draws["a"] == plain.draws["a"]
    assert compute.guesses == {"used": 0, "dropped": 1}
    settled(compute)  # its own guess, after the step that was sent
    assert eng.cache.length("a") == len(PROMPT) + 2


def test_a_release_or_a_probe_finds_the_kv_as_the_steps_left_it(ckpt):
    async def run() -> tuple[int, int, StageCompute]:
        eng = engine(ckpt, LayerRange(0, 4))
        compute = StageCompute(eng, run_ahead=True)
        await compute.start(received([SequenceStep("a", tuple(range(len(PROMPT))), PROMPT, sampling=SAMPLED)]))
        settled(compute)
        held = await compute.on_thread(lambda: eng.cache.length("a"))
        await compute.start(received([SequenceStep("a", (len(PROMPT),), (3,), sampling=SAMPLED)]))
        settled(compute)
        await compute.on_thread(eng.probe)
        return held, eng.cache.length("a"), compute

    held, after_probe, compute = asyncio.run(run())
    assert (held, after_probe) == (len(PROMPT), len(PROMPT) + 1)
    assert compute.guesses == {"used": 0, "dropped": 2}


def test_no_guess_when_the_header_does_not_allow_it_or_a_step_is_already_waiting(ckpt):
    async def run() -> StageCompute:
        compute = StageCompute(engine(ckpt, LayerRange(0, 4)), run_ahead=True)
        prompt = SequenceStep("a", tuple(range(len(PROMPT))), PROMPT, sampling=SAMPLED)
        out = await compute.start(received([prompt], run_ahead=False))
        settled(compute)
        token = out.draws["a"].token_id
        first = compute.start(received([SequenceStep("a", (len(PROMPT),), (token,), sampling=SAMPLED)]))
        second = compute.start(received([SequenceStep("b", (0, 1), (4, 5), sampling=SAMPLED)]))  # queued behind
        await first
        await second
        settled(compute)
        return compute

    compute = asyncio.run(run())
    assert compute.guesses == {"used": 0, "dropped": 0}
    assert compute.engine.steps_computed == 4  # three steps and the guess after the last
    assert compute.engine.cache.length("b") == 3


def test_a_first_stage_of_two_guesses_from_the_tokens_the_last_stage_drew(ckpt):
    async def run(first: StageEngine, last: StageEngine, *, ahead: bool) -> tuple[torch.Tensor, StageCompute]:
        compute = StageCompute(first, run_ahead=ahead)
        step = received([SequenceStep("a", tuple(range(len(PROMPT))), PROMPT)])
        out = await compute.start(step, chain="c")
        drawn = last.run([SequenceStep("a", s.positions, sampling=SAMPLED) for s in out.kept], out.hidden)
        token = drawn.draws["a"].token_id
        compute.drawn(step, out, {"a": token})  # the acknowledgement's tokens
        settled(compute)
        nxt = await compute.start(received([SequenceStep("a", (len(PROMPT),), (token,))]), chain="c")
        assert nxt.hidden is not None
        return nxt.hidden, compute

    plain, _ = asyncio.run(run(engine(ckpt, LayerRange(0, 2)), engine(ckpt, LayerRange(2, 4)), ahead=False))
    hidden, compute = asyncio.run(run(engine(ckpt, LayerRange(0, 2)), engine(ckpt, LayerRange(2, 4)), ahead=True))
    assert torch.equal(hidden, plain)
    assert compute.guesses == {"used": 1, "dropped": 0}


def test_only_a_plain_step_that_ran_whole_implies_the_next():
    a = SequenceStep("a", (4,), (9,), sampling=SAMPLED)
    ran = StepOutput(kept=[a], draws={"a": Draw(11)})
    assert guess([a], ran, {"a": 11}) == (SequenceStep("a", (5,), (11,), sampling=SAMPLED),)
    assert guess([a], ran, {}) is None  # drew nothing
    penalized = SequenceStep("a", (4,), (9,), sampling=SamplingParams(repetition_penalty=1.2), history=(1, 9))
    assert guess([penalized], StepOutput(kept=[penalized]), {"a": 11}) is None
    drafted = SequenceStep("a", (4, 5), (9, 10), sampling=SAMPLED, draft=1)
    assert guess([drafted], StepOutput(kept=[drafted]), {"a": 11}) is None
    assert guess([a, SequenceStep("b", (0,), (1,))], ran, {"a": 11, "b": 2}) is None  # b failed here
    assert guess([a], ran, {"a": 11}, ends=(2, 11)) is None  # it drew the end of its sequence


def test_a_step_that_releases_a_sequence_is_not_the_guess_even_when_the_rest_matches(ckpt):
    async def run() -> tuple[StepOutput, StageCompute]:
        eng = engine(ckpt, LayerRange(0, 4))
        compute = StageCompute(eng, run_ahead=True)
        await compute.start(received([SequenceStep("b", (0, 1), (4, 5), sampling=SAMPLED)], run_ahead=False), chain="c")
        prompt = SequenceStep("a", tuple(range(len(PROMPT))), PROMPT, sampling=SAMPLED)
        first = await compute.start(received([prompt]), chain="c")
        settled(compute)
        nxt = SequenceStep("a", (len(PROMPT),), (first.draws["a"].token_id,), sampling=SAMPLED)
        out = await compute.start(received([nxt], run_ahead=False, release=["b"]), chain="c")
        assert "b" not in eng.cache and eng.cache.length("a") == len(PROMPT) + 1
        return out, compute

    out, compute = asyncio.run(run())
    assert not out.errors and compute.guesses == {"used": 0, "dropped": 1}


def first_mark(s: SchedSequence, **kwargs: object) -> bool:
    """Whether the first step the scheduler sends for `s` alone is marked run_ahead."""

    async def run() -> bool:
        sender = HeldSteps()
        sched = started(sender, depth=1, **kwargs)
        sched.add(s)
        await settle()
        await sched.stop()
        return sender.steps[0][0].run_ahead

    return asyncio.run(run())


def test_the_scheduler_marks_a_step_run_ahead_only_when_its_next_is_certain_but_for_an_end():
    assert first_mark(seq("a", [1, 2, 3]))
    last = seq("a", [1, 2, 3])
    last.max_generated = 1  # its first token is its last
    assert not first_mark(last)
    penalized = seq("a", [1, 2, 3])
    penalized.sampling = SamplingParams(repetition_penalty=1.3)  # the stage reads its history
    assert not first_mark(penalized)
    drafting = seq("a", [1, 2, 3])
    drafting.speculate = 2  # its next step may verify drafted tokens
    assert not first_mark(drafting)


def names(step: PlannedStep) -> list[str]:
    return [s.seq.sequence_id for s in step.slices]


def test_a_step_of_two_sequences_is_not_run_ahead():
    async def run() -> tuple[int, bool]:
        sender = HeldSteps()
        sched = started(sender, depth=1)
        sched.add(seq("a", [1, 2, 3]))
        sched.add(seq("b", [4, 5]))
        await settle()
        step: PlannedStep = sender.steps[0][0]
        await sched.stop()
        return len(step.slices), step.run_ahead

    assert asyncio.run(run()) == (2, False)


def test_a_request_that_arrives_while_a_lone_stream_runs_ahead_joins_the_step_after_the_promised_one():
    async def run(depth: int) -> list[tuple[list[str], bool]]:
        sender = HeldSteps()
        sched = started(sender, depth=depth)
        sched.add(seq("a", [1, 2, 3]))
        await settle()  # step 0: a's prompt, drawing its first token; its next step is promised
        sched.add(seq("b", [4, 5, 6]))  # arrives while step 0 is out
        await settle()
        sent = len(sender.steps)
        sender.answer(0)
        await settle()
        sender.answer(1)
        await settle()
        await sched.stop()
        assert sent == (1 if depth == 1 else 2)  # deeper, b's step goes at once beside a's
        return [(names(step), step.run_ahead) for step, _ in sender.steps]

    # Step 1 is the one step 0 promised, so a first stage's guess serves it; b waits for it.
    assert asyncio.run(run(1)) == [(["a"], True), (["a"], False), (["a", "b"], False)]
    assert asyncio.run(run(2))[:2] == [(["a"], True), (["b"], False)]


def test_a_promise_is_dropped_when_its_sequence_ends_fails_over_or_is_refused_kv():
    async def run(end: str) -> list[list[str]]:
        sender = HeldSteps()
        moved: list[list[str]] = []

        def failed(seqs: list[SchedSequence], err: StepFailed) -> None:  # as the cluster's: they leave the chain
            moved.append([s.sequence_id for s in seqs])
            for s in seqs:
                sched.sequences.pop(s.sequence_id)

        sched = ChainScheduler(sender, depth=1, on_step_failed=failed, release=sender.release)
        sched.start()
        a = seq("a", [1, 2, 3])
        sched.add(a)
        await settle()
        sched.add(seq("b", [4, 5]))
        if end == "finish":
            sched.finish(a)  # a is cancelled while its run-ahead step is out
            sender.answer(0)
        elif end == "fail":
            sender.steps[0][1].set_exception(StepFailed(Code.UNAVAILABLE, "gone", failed_address="x"))
        else:  # a stage refused a's KV: it waits to be recomputed, under a new name, after a pause
            sender.steps[0][1].set_result([Outcome(a.kv_id, error_code=Code.RESOURCE_EXHAUSTED, error_message="full")])
        await settle()
        await sched.stop()
        assert sender.steps[0][0].run_ahead
        return [names(step) for step, _ in sender.steps[1:]] + moved

    # The promise cannot be kept: b starts at once, and nothing decodes a without its KV.
    assert asyncio.run(run("finish")) == [["b"]]
    assert asyncio.run(run("fail")) == [["b"], ["a"]]
    assert asyncio.run(run("refused")) == [["b"]]


def test_a_step_that_leaves_a_sequence_waiting_is_not_run_ahead():
    async def run() -> tuple[bool, list[str], bool]:
        sender = HeldSteps()
        sched = started(sender, depth=1, block_size=4, kv_blocks=2)
        sched.add(seq("a", [1, 2, 3]))
        await settle()
        sched.add(seq("b", [4, 5, 6, 7, 8, 9]))  # two blocks: only one is free beside a's
        sender.answer(0)
        await settle()
        step: PlannedStep = sender.steps[1][0]
        await sched.stop()
        return sender.steps[0][0].run_ahead, [s.seq.sequence_id for s in step.slices], step.run_ahead

    assert asyncio.run(run()) == (True, ["a"], False)
