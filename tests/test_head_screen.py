"""A greedy step's LM head through its int8 screen (stage_worker/head_screen.py, blocks.c): the whole
head's argmax and logit to the bit, ties to the first, on random and near-tied rows in float32 and
bfloat16; the bound it rests on; rows it leaves to the whole head; a stage whose greedy steps take it
and give the modules' tokens, while sampling with log-probabilities reads the whole head."""

from __future__ import annotations

import pytest
import torch

from layerline.shared.model_config import LayerRange
from layerline.shared.sampling import SamplingParams
from layerline.stage_worker import fma_blocks, head_screen
from layerline.stage_worker.engine import SequenceStep, StageEngine
from layerline.stage_worker.head_screen import HeadScreen
from layerline.stage_worker.kv_cache import CacheShape, PagedKVCache
from layerline.stage_worker.sampler import reads_argmax
from layerline.stage_worker.weights import load_stage

from .row_kernels import block_dtype
from .tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def dtype(request, monkeypatch):
    """Each dtype whose block kernel builds here and packs its weights, for this test only."""
    yield from block_dtype(request, monkeypatch)


@pytest.fixture
def screened_rows(monkeypatch) -> list[int]:
    """The rows of each call the screen answered (HeadScreen.forward not None), for this test."""
    calls: list[int] = []
    screened = HeadScreen.forward

    def counted(self, x):
        answer = screened(self, x)
        calls.extend([x.shape[0]] if answer is not None else [])
        return answer

    monkeypatch.setattr(HeadScreen, "forward", counted)
    return calls


def _head(dtype: torch.dtype, out: int = 512, fan_in: int = 96, seed: int = 0) -> torch.Tensor:
    """A random [out, in] head whose rows 300 and 301 repeat rows 7 and 8 (outputs that tie)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out, fan_in, generator=generator) * 0.1
    weight[300:302] = weight[7:9]
    return weight.to(dtype)


def test_the_screen_finds_the_whole_heads_argmax_and_logit_to_the_bit(dtype):
    """Rows of every scale, rows along one output's weights (a clear winner) and along the sum of
    two outputs' (a near tie), rows along a repeated output (an exact tie: the first wins); the
    vocabulary shorter than the padded head (the padding never chosen)."""
    weight, vocab = _head(dtype), 500
    blocked = fma_blocks.layout(weight)
    screen = HeadScreen(blocked, vocab)
    whole = fma_blocks.BoundBlocks(blocked, None)
    generator = torch.Generator().manual_seed(1)
    scales = (1e-39, 1e-20, 1e-3, 0.3, 1.0, 10.0, 300.0)  # the first two: sums below float32's normal numbers
    rows = [torch.randn(1, 96, generator=generator) * scale for scale in scales]
    rows += [weight[j : j + 1].float() * 5 for j in (0, 7, 31, 32, 301, 499)]
    rows += [(weight[j : j + 1] + weight[j + 1 : j + 2]).float() for j in (3, 40, 200)]
    rows += [torch.randn(1, 96, generator=generator) for _ in range(200)]
    firsts = 0
    for row in rows:
        x = row.to(dtype)
        logits = whole(x)[0, :vocab].float()
        got = screen(x)
        assert got is not None and got.shape == (1, vocab)
        assert int(got.argmax()) == int(logits.argmax())
        assert float(got.max()) == float(logits.max())
        assert int(torch.isfinite(got).sum()) == 1
        firsts += int(logits.argmax()) in (7, 8)
    assert firsts >= 2  # the rows along output 7 and 301 chose 7, the first of the tie
    screen.max_rows = 12  # bfloat16 too (in a step it screens up to 4: MAX_ROWS)
    for count in range(2, 13):  # several rows at once: each row's answer alone
        x = torch.cat(rows[count : 2 * count]).to(dtype)
        logits, got = whole(x)[:, :vocab].float(), screen(x)
        assert got is not None and got.shape == (count, vocab)
        assert got.argmax(1).tolist() == logits.argmax(1).tolist()
        assert got.max(1).values.tolist() == logits.max(1).values.tolist()


def test_the_bound_holds_for_every_output():
    """|x . w_j - screen_j| <= ||x|| c_j, the product and the screen as the kernels compute them."""
    weight = _head(torch.float32, out=1024, fan_in=576, seed=3)
    blocked = fma_blocks.layout(weight)
    screen = HeadScreen(blocked, 1024)
    if fma_blocks.block_kernel(torch.float32) is None:
        pytest.skip("no block kernel with AVX-512 here")
    whole = fma_blocks.BoundBlocks(blocked, None)
    generator = torch.Generator().manual_seed(4)
    for scale in (1e-2, 1.0, 1e3):
        x = torch.randn(1, 576, generator=generator) * scale
        gap = (whole(x) - screen.products(x)).abs()[0].double()
        assert bool((gap <= x.double().norm() * screen.bounds.double()).all())


def test_rows_it_cannot_screen_are_left_to_the_whole_head(dtype):
    screen = HeadScreen(fma_blocks.layout(_head(dtype)), 512)
    for bad in (float("nan"), float("inf")):
        x = torch.zeros(3, 96, dtype=dtype)
        x[1, 5] = bad  # one row of three
        assert screen(x) is None
    with pytest.raises(ValueError, match="rows of 96"):
        screen(torch.zeros(2, 95, dtype=dtype))
    assert screen(torch.zeros(head_screen.MAX_ROWS[dtype] + 1, 96, dtype=dtype)) is None  # more: the whole head


def test_only_plain_greedy_rows_read_the_argmax_alone():
    assert reads_argmax(None) and reads_argmax(SamplingParams())
    assert not reads_argmax(SamplingParams(temperature=0.5))
    assert not reads_argmax(SamplingParams(repetition_penalty=1.2))
    assert not reads_argmax(SamplingParams(logprobs=0))


def _engine(path, dtype: torch.dtype) -> StageEngine:
    model = load_stage(path, LayerRange(0, 2), dtype=dtype)
    cfg = model.config
    cache = PagedKVCache(CacheShape(32, 8, cfg.num_kv_heads, cfg.head_dim), layer_ids=model.layer_range, dtype=dtype)
    return StageEngine(model, cache)


def _decode(engine: StageEngine, prompt: list[int], steps: int, sampling: SamplingParams | None) -> list:
    step = SequenceStep("s", tuple(range(len(prompt))), tuple(prompt), sampling=sampling)
    draws = []
    for _ in range(steps):
        out = engine.run([step])
        assert not out.errors
        draw = out.draws["s"]
        draws.append(draw)
        position = step.positions[-1] + 1
        step = SequenceStep("s", (position,), (draw.token_id,), sampling=sampling)
    return draws


def test_a_stages_greedy_steps_take_the_screen_and_the_wholes_tokens(tmp_path, monkeypatch, dtype, screened_rows):
    """A lone greedy sequence's decode steps go through the screen, and give the tokens and the
    log-probabilities of the stage without it; a sequence that asks for log-probabilities does not
    take it; LAYERLINE_GREEDY_SCREEN=off makes none."""
    make_tiny_checkpoint("smollm2", tmp_path, num_layers=2, vocab_size=256, hidden_size=96, intermediate_size=128)
    calls = screened_rows
    engine = _engine(tmp_path, dtype)
    assert isinstance(engine.model.head_screen, HeadScreen)
    greedy = [d.token_id for d in _decode(engine, [1, 17, 42, 99], 12, None)]
    assert calls == [1] * 12  # the prompt's last row, then every decode step's
    asking = _decode(_engine(tmp_path, dtype), [1, 17, 42, 99], 12, SamplingParams(logprobs=2))
    assert len(calls) == 12 and [d.token_id for d in asking] == greedy
    assert all(len(d.top) == 2 and all(p > -1e9 for _, p in d.top) for d in asking)
    monkeypatch.setenv(head_screen.ENV, "off")
    whole = _engine(tmp_path, dtype)
    assert whole.model.head_screen is None
    assert [d.token_id for d in _decode(whole, [1, 17, 42, 99], 12, None)] == greedy


def test_a_decode_batch_and_a_verify_step_take_it_for_few_greedy_rows(tmp_path, monkeypatch, dtype, screened_rows):
    """Three sequences decoding together, and one verifying three drafted tokens (four rows), read
    the head through the screen, with the tokens of the whole head."""
    make_tiny_checkpoint("smollm2", tmp_path, num_layers=2, vocab_size=256, hidden_size=96, intermediate_size=128)
    calls = screened_rows
    prompts = {"a": [1, 17, 42, 99], "b": [5, 6], "c": [9, 9, 9]}

    def run(engine: StageEngine) -> list[list[int]]:
        steps = [SequenceStep(n, tuple(range(len(p))), tuple(p)) for n, p in prompts.items()]
        tokens: list[list[int]] = [[] for _ in prompts]
        for _ in range(6):
            out = engine.run(steps)
            assert not out.errors
            for i, step in enumerate(steps):
                tokens[i].append(out.draws[step.sequence_id].token_id)
            steps = [SequenceStep(s.sequence_id, (s.positions[-1] + 1,), (t[-1],)) for s, t in zip(steps, tokens)]
        # "a" alone, verifying three drafted tokens (its last three): four rows of logits
        a = steps[0]
        drafted = SequenceStep(
            "a",
            tuple(range(a.positions[0], a.positions[0] + 4)),
            (a.token_ids[0], *tokens[0][-3:]),
            sampling=SamplingParams(),
            draft=3,
        )
        out = engine.run([drafted])
        assert not out.errors
        return [*tokens, [d.token_id for d in out.accepted.get("a", ())] + [out.draws["a"].token_id]]

    got = run(_engine(tmp_path, dtype))
    assert 3 in calls and 4 in calls  # the batch's rows, the verify step's
    monkeypatch.setenv(head_screen.ENV, "off")
    assert run(_engine(tmp_path, dtype)) == got
