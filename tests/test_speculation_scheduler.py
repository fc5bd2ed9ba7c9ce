"""The coordinator's scheduler speculating by prompt lookup, over two tiny stage engines in this
process: the same tokens as without speculation, fewer steps on a repeating answer, never past
the sequence's length, and no KV left on a stage once a sequence ends or is cancelled."""

from __future__ import annotations

import asyncio

import pytest

from layerline.coordinator.scheduler import ChainScheduler
from layerline.coordinator.steps import Outcome, PlannedStep, Sequence, StepFailed, Token
from layerline.shared.errors import Code
from layerline.shared.sampling import SamplingParams
from layerline.stage_worker.engine import SequenceStep

from .test_speculation import engines
from .tiny_models import make_tiny_checkpoint

# A prompt whose greedy answer, on the tiny model, settles into a loop that prompt lookup finds.
PROMPT = [1, 5, 9, 30, 31, 5, 9, 30, 44, 7, 7, 12, 5, 9]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("speculation-scheduler")
    make_tiny_checkpoint("smollm2", path)
    return path


class EngineChain:
    """A StepSender that runs each step through two stage engines, as a chain's stages would."""

    def __init__(self, ckpt, *, fail_at: int = 0) -> None:
        self.first, self.last = engines(ckpt)
        self.steps = 0
        self.fail_at = fail_at  # the step that fails as if a stage died (0: none)
        self.fed: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []  # (KV name, token ids, draft) of each slice

    async def __call__(self, step: PlannedStep) -> list[Outcome]:
        self.steps += 1
        self.fed += [(s.seq.kv_id, s.token_ids, s.draft) for s in step.slices]
        if self.steps == self.fail_at:
            raise StepFailed(Code.UNAVAILABLE, "stage 2 died")
        for name in step.release:
            self.first.release(name)
            self.last.release(name)
        seqs = [
            SequenceStep(
                s.seq.kv_id,
                tuple(range(s.start, s.start + len(s.token_ids) + len(s.draft))),
                s.token_ids + s.draft,
                s.seq.sampling if s.sample else None,
                tuple(s.seq.history) if s.sample and s.seq.sampling.repetition_penalty != 1.0 else (),
                draft=len(s.draft),
                rewind=s.rewind,
            )
            for s in step.slices
        ]
        a = self.first.run(seqs)
        b = self.last.run(a.kept, a.hidden)
        assert not a.errors and not b.errors
        await asyncio.sleep(0)
        return [
            Outcome(
                s.sequence_id,
                token_id=b.draws[s.sequence_id].token_id if s.sampling is not None else None,
                accepted=tuple(Token(d.token_id, d.logprob, d.top) for d in b.accepted.get(s.sequence_id, ())),
            )
            for s in seqs
        ]

    async def release(self, names: list[str]) -> None:
        for name in names:
            self.first.release(name)
            self.last.release(name)

    def held(self) -> list[str]:
        return self.first.cache.sequences() + self.last.cache.sequences()


async def generate(chain: EngineChain, n: int, *, speculate: int, sampling: SamplingParams, stop_after: int = 0):
    """`n` tokens of PROMPT (or a cancel after `stop_after` tokens); the tokens the sequence got."""
    counts = [0, 0]  # drafted, accepted

    def speculated(drafted: int, accepted: int) -> None:
        counts[0] += drafted
        counts[1] += accepted

    def failed(seqs: list[Sequence], err: StepFailed) -> None:
        for s in seqs:  # its KV is lost with the chain (and its ledger): rebuilt from its history, as after a move
            sched.held.pop(s.replace_kv())
            sched.add(s)

    sched = ChainScheduler(chain, depth=1, on_step_failed=failed, release=chain.release, on_speculated=speculated)
    sched.start()
    got: list[int] = []
    ended = asyncio.Event()

    def on_token(token: int, *_: object) -> None:
        got.append(token)
        if len(got) == n:
            seq.done = seq.complete = True  # its length: no token after this one is its
        if len(got) == (stop_after or n):
            ended.set()  # then the cluster finishes it: at its end, or cancelled

    seq = Sequence("s", list(PROMPT), sampling, on_token, lambda *a: None, speculate=speculate, max_generated=n)
    sched.add(seq)
    await asyncio.wait_for(ended.wait(), 60)
    sched.finish(seq)
    for _ in range(10):
        await asyncio.sleep(0)
    await sched.stop()
    assert seq.fed <= len(seq.history) and sched.held == {}
    return got, counts[0], counts[1]


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(), SamplingParams(temperature=0.1, top_k=5, seed=5, repetition_penalty=1.05)],
    ids=["greedy", "seeded"],
)
def test_speculation_gives_the_same_tokens_in_fewer_steps_and_frees_the_kv(ckpt, sampling):
    plain_chain, spec_chain = EngineChain(ckpt), EngineChain(ckpt)
    plain, drafted, _ = asyncio.run(generate(plain_chain, 40, speculate=0, sampling=sampling))
    spec, drafted, accepted = asyncio.run(generate(spec_chain, 40, speculate=6, sampling=sampling))
    assert spec == plain and len(spec) == 40  # never a token past the sequence's length
    assert plain_chain.steps == 40  # the prompt and its first token, then one token a step
    assert 0 < accepted <= drafted and spec_chain.steps <= 40 - accepted  # each accepted token saved a step
    assert plain_chain.held() == [] and spec_chain.held() == []  # released when the sequence ended


def test_a_cancelled_speculating_sequence_leaves_no_kv(ckpt):
    chain = EngineChain(ckpt)
    got, drafted, _ = asyncio.run(generate(chain, 40, speculate=6, sampling=SamplingParams(), stop_after=9))
    assert 9 <= len(got) < 40 and drafted > 0 and chain.held() == []


def test_a_draft_takes_only_free_kv():
    from .test_scheduler import HeldSteps, settle, started

    async def run(kv_blocks: int) -> tuple[int, ...]:
        sender = HeldSteps()
        sched = started(sender, depth=1, kv_blocks=kv_blocks, block_size=1)
        s = Sequence("s", [7] * 8, SamplingParams(), lambda *a: None, lambda *a: None, speculate=8, max_generated=50)
        sched.add(s)
        await settle()
        sender.answer(0)  # the prompt, and its first token (7): the history repeats, so 7 is drafted next
        await settle()
        (decode,) = sender.steps[1][0].slices
        await sched.stop()
        return decode.draft

    assert asyncio.run(run(kv_blocks=10)) == (7,)  # 8 held, its next token and one drafted: 10
    assert asyncio.run(run(kv_blocks=9)) == ()  # room for its next token only: no draft


def test_a_failed_step_replays_only_accepted_tokens(ckpt):
    plain, _, _ = asyncio.run(generate(EngineChain(ckpt), 30, speculate=0, sampling=SamplingParams()))
    chain = EngineChain(ckpt, fail_at=8)  # a step with a draft in flight when its chain fails
    spec, _, accepted = asyncio.run(generate(chain, 30, speculate=6, sampling=SamplingParams()))
    assert spec == plain and accepted > 0
    name, lost, draft = chain.fed[7]
    assert name == "s" and draft  # the failed step verified a draft
    replay = next((tokens, draft) for kv, tokens, draft in chain.fed if kv == "s.1")
    assert replay[0] == tuple(PROMPT) + tuple(spec[: len(replay[0]) - len(PROMPT)])  # accepted tokens only
    assert replay[0][-len(lost) :] == lost and not replay[1]  # up to the failed step's token, no draft
