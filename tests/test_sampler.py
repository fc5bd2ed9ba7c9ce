"""A sampled token's draw: the filters on candidates against the same filters on the whole vocabulary,
and the draws against the distribution they keep (seeded, so every count here is fixed)."""

from __future__ import annotations

import math

import pytest
import torch

from layerline.shared.sampling import SamplingParams
from layerline.stage_worker import sampler
from layerline.stage_worker.sampler import sample


def masked(scores: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The filters as transformers' warpers apply them, on the whole vocabulary: probabilities [vocab]."""
    if 0 < p.top_k < scores.numel():
        scores = scores.masked_fill(scores < torch.topk(scores, p.top_k).values[-1], float("-inf"))
    if p.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True)
        probs = ordered.softmax(-1)
        drop = probs.cumsum(-1) - probs >= p.top_p
        scores = scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = scores.softmax(-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def kept(scores: torch.Tensor, p: SamplingParams, *, batched: bool = False) -> torch.Tensor:
    """`sampler._kept` as probabilities over the vocabulary, renormalized; `batched`: given the
    softmax and its most likely HEAD, as a step's rows are (`_drawn_rows`)."""
    extra = {}
    if batched and not 0 < p.top_k < scores.numel():
        softmax = scores.softmax(-1)
        extra = {"probs": softmax, "head": softmax.topk(min(sampler.HEAD, scores.numel()))}
    probs, ids = sampler._kept(scores, p, **extra)
    full = torch.zeros_like(scores)
    full[torch.arange(scores.numel()) if ids is None else ids] = probs
    return full / full.sum()


def rows() -> list[torch.Tensor]:
    """Peaked rows like a language model's (top-p's nucleus within the most likely 256), flat ones
    (it then needs more than 256 candidates, or the whole vocabulary), and rows with -inf in them."""
    generator = torch.Generator().manual_seed(5)
    out = [peaked(generator)]
    for vocab, scale in ((49152, 4.0), (49152, 0.3), (49152, 0.01), (1000, 2.0), (7, 1.0)):
        out.append(torch.randn(vocab, generator=generator) * scale)
    holes = torch.randn(3000, generator=generator)
    holes[::3] = float("-inf")
    return [*out, holes]


def peaked(generator: torch.Generator) -> torch.Tensor:
    """49152 logits, 20 of them far above the rest: all but 1e-4 of the probability in them."""
    scores = torch.randn(49152, generator=generator)
    scores[torch.randperm(49152, generator=generator)[:20]] += 16.0
    return scores


def test_a_peaked_rows_nucleus_comes_from_its_most_likely_256():
    scores = peaked(torch.Generator().manual_seed(2))
    softmax = scores.softmax(-1)
    head = softmax.topk(sampler.HEAD)
    values, ids = sampler._most_likely(softmax, 0.999, head)
    assert values is head[0] and ids is head[1]  # no other topk, no sort
    assert int((kept(scores, SamplingParams(temperature=1.0, top_p=0.999), batched=True) > 0).sum()) <= 256


@pytest.mark.parametrize("top_k", [0, 1, 5, 50, 300])
@pytest.mark.parametrize("top_p", [1.0, 0.999, 0.9, 0.5, 0.01])
@pytest.mark.parametrize("min_p", [0.0, 0.05])
def test_the_candidates_keep_what_masking_the_vocabulary_keeps(top_k, top_p, min_p):
    """The same tokens with the same probabilities, but for a few whose probabilities sum to less than
    1e-4, at the top-p boundary of a flat row, where the two sum in different orders."""
    p = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, min_p=min_p)
    for scores in rows():
        expected = masked(scores, p)
        for got in (kept(scores, p), kept(scores, p, batched=True)):
            differ = (got > 0) != (expected > 0)
            if p.top_p < 1.0:  # at p's boundary float32 sums of thousands of terms may keep a few more or fewer
                assert float(scores.softmax(-1)[differ].sum()) < 1e-4, (scores.numel(), p)
            else:
                assert not differ.any(), (scores.numel(), p)
            assert torch.allclose(got[~differ], expected[~differ], rtol=1e-3, atol=1e-7)


def test_tokens_tied_with_the_kth_are_kept_as_transformers_keeps_them():
    scores = torch.tensor([3.0, 1.0, 2.0, 2.0, 0.5, 2.0, -1.0])
    p = SamplingParams(temperature=1.0, top_k=2)  # the 2nd highest, 2.0, is tied three ways
    assert (kept(scores, p) > 0).tolist() == [True, False, True, True, False, True, False]
    assert torch.allclose(kept(scores, p), masked(scores, p))
    nucleus = SamplingParams(temperature=1.0, top_k=2, top_p=0.6)  # the first two of them reach 0.6
    assert int((kept(scores, nucleus) > 0).sum()) == 2


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.7, top_p=0.8, seed=12),
        SamplingParams(temperature=1.3, top_k=3, seed=13),
        SamplingParams(temperature=1.0, min_p=0.2, seed=14),
    ],
)
def test_draws_follow_the_distribution_they_keep(params):
    """20000 seeded draws (one per position) from a row of 6 tokens: each token's count within 5
    standard deviations of its kept probability's, and a dropped token never drawn."""
    logits = torch.tensor([[2.0, 1.5, 0.2, -0.5, 1.0, -3.0]])
    expected = masked(logits[0] / params.temperature, params)
    n = 20000
    counts = [0] * logits.shape[1]
    for position in range(n):
        counts[sample(logits, [params], histories=[()], positions=[position])[0].token_id] += 1
    for count, q in zip(counts, expected.tolist()):
        if q == 0.0:
            assert count == 0
        else:
            assert abs(count - n * q) <= 5 * math.sqrt(n * q * (1 - q)) + 1, (counts, expected)
    filtered = params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0
    assert (min(counts) == 0) == filtered  # the filters dropped a token here, and only they did


def test_a_seed_draws_the_same_token_whatever_shares_the_batch():
    """Each row drawn alone and in a batch of every kind of row (greedy, temperature alone, top-p
    through the batch's most likely 256 and past them, top-k with and without top-p, min-p, a
    repetition penalty): the same tokens."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 49152, generator=generator) * 3
    logits[0] = peaked(generator)  # its nucleus within the most likely 256
    logits[5] *= 0.05  # flat: its nucleus is past them
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, seed=99),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=5),
        SamplingParams(temperature=1.0, top_k=9, seed=6),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.5, min_p=0.1, seed=7),
        SamplingParams(temperature=1.2, top_p=0.9, seed=8),
        SamplingParams(temperature=0.8, min_p=0.05, seed=9),
        SamplingParams(temperature=0.8, repetition_penalty=1.3, top_p=0.9, seed=10),
    ]
    histories = [(), (), (), (), (), (), (), (1, 2, 3)]
    positions = list(range(17, 25))
    batched = [d.token_id for d in sample(logits, params, histories=histories, positions=positions)]
    alone = [
        sample(logits[i : i + 1], [params[i]], histories=[histories[i]], positions=[positions[i]])[0].token_id
        for i in range(len(params))
    ]
    assert batched == alone
    assert torch.equal(logits, before)  # read, not written
    reordered = [7, 3, 0, 5]
    again = sample(
        logits[reordered],
        [params[i] for i in reordered],
        histories=[histories[i] for i in reordered],
        positions=[positions[i] for i in reordered],
    )
    assert [d.token_id for d in again] == [alone[i] for i in reordered]


@pytest.mark.parametrize(
    "row,params",
    [
        ([float("nan")] * 8, SamplingParams(temperature=1.0)),
        ([-float("inf")] * 8, SamplingParams(temperature=0.5, top_p=0.9)),
        ([float("nan"), 2.0, 2.0, 2.0, 1.0], SamplingParams(temperature=1.0, top_k=2)),  # NaN beside a tie at the k-th
        ([3.0, float("nan"), 1.0], SamplingParams(temperature=1.0, top_k=2, seed=4)),
    ],
)
def test_logits_with_nothing_to_draw_are_refused_by_name(row, params):
    with pytest.raises(ValueError, match="no token to draw"):
        sample(torch.tensor([row]), [params], histories=[()], positions=[0])


def test_a_top_k_of_the_whole_vocabulary_keeps_it_all():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(8))
    every = [SamplingParams(temperature=0.9, top_k=k, seed=21) for k in (0, 40, 41)]
    drawn = {tuple(d.token_id for d in sample(logits, [p] * 3, histories=[()] * 3, positions=[1, 2, 3])) for p in every}
    assert len(drawn) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_rows_on_a_gpu_draw_kept_tokens_and_seeds_reproduce():
    """The generators are the CPU's; the rows stay on the device. A seeded row draws the same token
    twice, and every drawn token is one the filters keep."""
    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(9)) * 3
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s) for s in range(3)] + [SamplingParams(temperature=1.0)]
    first, again = (sample(logits.cuda(), params, histories=[()] * 4, positions=[5] * 4) for _ in range(2))
    assert [d.token_id for d in first[:3]] == [d.token_id for d in again[:3]]
    for row, p, d in zip(logits, params, first):
        assert masked(row / p.temperature, p)[d.token_id] > 0
