"""Speculative decoding by prompt lookup: drafts, their verification on the stages, the KV of
rejected tokens dropped, and output token for token the same as without speculation."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from layerline.coordinator.prompt_lookup import MAX_NGRAM, MIN_NGRAM, PromptLookup
from layerline.shared.model_config import LayerRange
from layerline.stage_worker.engine import SequenceStep, StageEngine
from layerline.stage_worker.kv_cache import CacheShape, PagedKVCache
from layerline.stage_worker.sampler import SamplingParams
from layerline.stage_worker.weights import load_stage

from .pipeline import LocalPipeline
from .tiny_models import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=1.0, top_p=0.95, seed=11, repetition_penalty=1.3, logprobs=2)
PROMPT = [1, 5, 9, 30, 31, 5, 9, 30, 44, 7, 7, 12]

Drafter = Callable[[int], list[int]]  # tokens generated so far -> the draft to verify next


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("speculation")
    make_tiny_checkpoint("smollm2", path)
    return path


def engines(ckpt) -> tuple[StageEngine, StageEngine]:
    out = []
    for layers in (LayerRange(0, 2), LayerRange(2, 4)):
        model = load_stage(ckpt, layers)
        cfg = model.config
        cache = PagedKVCache(CacheShape(32, 4, cfg.num_kv_heads, cfg.head_dim), layer_ids=layers, dtype=torch.float32)
        out.append(StageEngine(model, cache))
    return out[0], out[1]


def decode(ckpt, sampling: SamplingParams, n: int, drafter: Drafter) -> tuple[list[int], list[float | None], int]:
    """`n` tokens through two stage engines, each step verifying `drafter`'s draft; the tokens,
    their logprobs and how many drafted tokens were accepted. Checks the KV each stage holds
    after every step: every stage keeps the rejected tokens' KV until the next step rewinds it."""
    first, last = engines(ckpt)
    history, generated, logprobs = list(PROMPT), [], []
    fed = held = accepted_total = 0
    while len(generated) < n:
        real = history[fed:]
        draft = drafter(len(generated))[: n - len(generated) - 1]
        step = SequenceStep(
            "s",
            tuple(range(fed, fed + len(real) + len(draft))),
            tuple(real + draft),
            sampling,
            tuple(history) if sampling.repetition_penalty != 1.0 else (),
            draft=len(draft),
            rewind=held > fed,
        )
        a = first.run([step])
        b = last.run(a.kept, a.hidden)
        assert not a.errors and not b.errors
        accepted = list(b.accepted.get("s", ()))
        assert [d.token_id for d in accepted] == draft[: len(accepted)]
        draws = [*accepted, b.draws["s"]]
        held = fed + len(real) + len(draft)
        fed += len(real) + len(accepted)
        assert last.cache.length("s") == first.cache.length("s") == held  # until the next step rewinds
        history += [d.token_id for d in draws]
        generated += [d.token_id for d in draws]
        logprobs += [d.logprob for d in draws]
        accepted_total += len(accepted)
    for engine in (first, last):
        assert engine.release("s")
        assert engine.cache.blocks_free == engine.cache.blocks_total
    return generated[:n], logprobs[:n], accepted_total


def from_reference(reference: list[int], k: int) -> Drafter:
    """Drafts of `k` tokens taken from the answer itself, right, half right or wrong in turn."""

    def drafter(done: int) -> list[int]:
        draft = list(reference[done : done + k])
        if draft and done % 3 == 1:
            draft[len(draft) // 2] = (draft[len(draft) // 2] + 1) % 200  # rejected from the middle on
        elif draft and done % 3 == 2:
            draft[0] = (draft[0] + 1) % 200  # rejected at once
        return draft

    return drafter


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_drafts_change_no_token_and_rejected_kv_is_dropped(ckpt, sampling):
    plain, plain_logprobs, none = decode(ckpt, sampling, 24, lambda done: [])
    assert none == 0
    for k in (1, 4):
        tokens, logprobs, accepted = decode(ckpt, sampling, 24, from_reference(plain, k))
        assert tokens == plain
        assert accepted >= 24 // (k + 1) // 3  # the drafts that were right were accepted
        if sampling.logprobs is not None:
            assert logprobs == pytest.approx(plain_logprobs, abs=1e-4)
    wrong, _, accepted = decode(ckpt, sampling, 12, lambda done: [(t + 1) % 200 for t in plain[done : done + 3]])
    assert wrong == plain[:12] and accepted == 0


def test_seeded_sampling_with_drafts_reproduces_and_differs_by_seed(ckpt):
    plain, _, _ = decode(ckpt, SEEDED, 16, lambda done: [])
    again, _, _ = decode(ckpt, SEEDED, 16, from_reference(plain, 3))
    other = SamplingParams(temperature=1.0, top_p=0.95, seed=12, repetition_penalty=1.3)
    differs, _, _ = decode(ckpt, other, 16, lambda done: [])
    assert again == plain and differs != plain


def test_bad_drafts_and_rewinds_fail_only_their_sequence(ckpt):
    first, last = engines(ckpt)
    a = first.run([SequenceStep("s", (0, 1, 2), (1, 2, 3)), SequenceStep("t", (0, 1), (4, 5))])
    last.run(a.kept, a.hidden)
    steps = [
        SequenceStep("s", (3, 4), (6, 7), GREEDY, draft=2),  # no undrafted token
        SequenceStep("t", (1, 2), (8, 9), GREEDY),  # repeats position 1 without rewind
        SequenceStep("u", (0, 1), (4, 5), None, draft=1),  # drafts without sampling
    ]
    a = first.run(steps)
    b = last.run(a.kept, a.hidden)
    errors = {e.sequence_id: str(e.error) for e in a.errors + b.errors}
    assert "draft = 2: must be fewer than its 2 positions" in errors["s"]
    assert "positions start at 1, expected 2" in errors["t"]
    assert "draft = 1: the last stage needs its sample set" in errors["u"]
    past = first.run([SequenceStep("t", (3,), (9,), rewind=True)])  # a rewind never skips ahead
    assert "positions start at 3, expected 2" in str(past.errors[0].error)
    # A refused rewind drops nothing: its token is checked before any KV goes.
    bad = first.run([SequenceStep("t", (0,), (10**6,), rewind=True)])
    assert "token id 1000000 is outside the vocabulary" in str(bad.errors[0].error)
    assert first.cache.length("t") == 2
    back = first.run([SequenceStep("t", (1, 2), (8, 9), rewind=True)])
    assert not back.errors and first.cache.length("t") == 3
    # A last stage reached directly checks the drafted ids it may index with (repetition penalty).
    hidden = torch.zeros(2, last.config.hidden_size)
    sampling = SamplingParams(repetition_penalty=1.3)
    far = last.run([SequenceStep("t", (2, 3), (8, 10**6), sampling, draft=1, rewind=True)], hidden)
    assert "draft holds a token id outside the vocabulary" in str(far.errors[0].error)
    assert first.cache.length("s") == 3 and "u" not in last.cache


def test_prompt_lookup_drafts_what_followed_the_longest_latest_match():
    lookup = PromptLookup()
    history = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 2, 3]
    assert lookup.draft(history, 3) == [7, 8, 2]  # [2, 3] last occurred before 7
    assert lookup.draft([*history, 4], 2) == [5, 9]  # [2, 3, 4] occurred once
    assert lookup.draft([*history, 4, 6], 2) == []  # nothing followed 6 before
    assert lookup.draft([*history, 4, 6, 5], 4) == []  # only [5] occurred before
    assert lookup.draft([*history, 4, 6, 5, 4, 5], 4) == [9, 2, 3, 7]  # [4, 5] did
    assert lookup.draft([*history, 4, 6, 5, 4, 5], 0) == []
    assert PromptLookup().draft([5, 6, 5, 6], 3) == [5, 6]  # [5, 6] occurred before: a bigram is enough
    assert PromptLookup().draft([5, 7, 5], 3) == []  # only [5] occurred before: one token is no draft
    assert (MIN_NGRAM, MAX_NGRAM) == (2, 3)


def test_a_drafts_length_halves_after_a_miss_and_doubles_after_a_hit():
    lookup = PromptLookup()
    history = list(range(20)) * 2  # whatever comes next was seen before: long drafts are possible
    assert len(lookup.draft(history[:30], 8)) == 8
    lookup.verified(8, 0)
    assert len(lookup.draft(history[:31], 8)) == 4
    lookup.verified(4, 2)  # partly right: the length stays
    assert len(lookup.draft(history[:32], 8)) == 4
    lookup.verified(4, 0)
    lookup.verified(2, 0)
    lookup.verified(1, 0)
    assert lookup.length == 1 and len(lookup.draft(history[:33], 8)) == 1
    lookup.verified(1, 1)
    lookup.verified(2, 2)
    assert len(lookup.draft(history[:34], 8)) == 4
    lookup.verified(4, 4)
    lookup.verified(8, 8)
    assert lookup.length == 16 and len(lookup.draft(history[:35], 8)) == 8  # within the caller's bound


def test_the_speculate_flag_is_checked_and_explained(capsys):
    from layerline.cli import main
    from layerline.coordinator.settings import CoordinatorSettings

    assert CoordinatorSettings().speculate == 0  # off unless asked
    assert CoordinatorSettings(speculate=16).speculate == 16
    for bad in (-1, 17):
        with pytest.raises(ValueError, match=rf"--speculate {bad} must be in \[0, 16\] \(0: off\)"):
            CoordinatorSettings(speculate=bad)
    for command in ("coordinator", "up"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--speculate K" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_drafted_tokens_rows_are_the_bits_of_steps_of_one_token(ckpt, dtype):
    """A step that feeds a token and drafts after it, or a prompt's last chunk and drafts after
    that, computes each drafted row as a step of that one token would, to the bit (its logits),
    and the tokens before the drafts as without them, in float32 and bfloat16 (where a rounding
    apart flips greedy tokens: `layerline bench speculate --dtype bfloat16` saw a greedy answer
    change when drafts attended as a prompt's chunk does). Where a lone row's kernels are not a
    batch's (rows.py, to a rounding), a drafted row cannot be a lone step's to the bit: skipped."""
    stages = [load_stage(ckpt, LayerRange(0, 2), dtype=dtype), load_stage(ckpt, LayerRange(2, 4), dtype=dtype)]
    alone, beside = LocalPipeline(stages), LocalPipeline(stages)
    alone.step({"s": PROMPT})
    beside.step({"s": PROMPT, "o": PROMPT[:5]})
    lone = alone.step({"s": [5]})
    if not torch.equal(beside.step({"s": [5], "o": [9]}, all_logits=True)[:1], lone):
        pytest.skip("a lone row's products or attention are not a batch row's here (to a rounding)")

    fed = [5, 9, 30, 44, 7, 12]  # a token, then 5 drafted after it
    one_at_a_time, at_once = LocalPipeline(stages), LocalPipeline(stages)
    for pipeline in (one_at_a_time, at_once):
        pipeline.step({"s": PROMPT})
    rows = torch.cat([one_at_a_time.step({"s": [t]}) for t in fed])
    assert torch.equal(at_once.step({"s": fed}, all_logits=True, drafts={"s": 5}), rows)

    head, tail, draft = PROMPT[:7], PROMPT[7:], [30, 44, 7]  # a prompt in two chunks, drafts after the last
    one_at_a_time, at_once = LocalPipeline(stages), LocalPipeline(stages)
    for pipeline in (one_at_a_time, at_once):
        pipeline.step({"s": head})
    rows = torch.cat(
        [one_at_a_time.step({"s": tail}, all_logits=True), *(one_at_a_time.step({"s": [t]}) for t in draft)]
    )
    assert torch.equal(at_once.step({"s": tail + draft}, all_logits=True, drafts={"s": 3}), rows)
