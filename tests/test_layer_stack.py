"""A step's layers in one call of the compiled kernels (stage_worker/layer_stack.py, kernels/layers.c):
the Python loops' numbers to the bit (the hidden states handed on, the logits, the KV written) for a
decode batch and a lone row, on a whole stage and a split one, with and without biases; where it
declines to serve; and what it refuses before any C runs."""

from __future__ import annotations

import pytest
import torch

from layerline.shared.model_config import LayerRange
from layerline.stage_worker import decode_path, layer_stack
from layerline.stage_worker.weights import load_stage

from .pipeline import cache_for
from .row_kernels import block_dtype
from .tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(180)
# Whole blocks of 32 outputs in every product, and SiLU halves its kernel takes (multiples of 32):
# smollm2's shape (6 heads, 2 KV heads of 16) and llama2's (4 heads of 16, attention and MLP biases).
SHAPES = {"smollm2": dict(hidden_size=96, intermediate_size=128), "llama2": dict(hidden_size=64, intermediate_size=96)}
PROMPTS = [[1, 17, 42, 99, 3, 5], [1, 7, 7, 200], [9, 4]] + [[5 + i, 11] for i in range(10)]  # 13: past a tile of 12


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def dtype(request, monkeypatch):
    """Each dtype whose block kernel builds here and packs its weights, for this test only."""
    yield from block_dtype(request, monkeypatch)


def _stages(path, split: list[LayerRange], dtype: torch.dtype, *, stack: bool):
    stages = [load_stage(path, layers, dtype=dtype) for layers in split]
    for stage in stages:
        stage.set_threads(2)
        assert stage.decode_path is not None and stage.row_path is not None
        assert stage.decode_path.stack is not None and stage.row_path.stack is not None
        if not stack:
            stage.decode_path.stack = stage.row_path.stack = None
    return stages


def _run(stages, prompts: list[list[int]], steps: int) -> tuple[list[torch.Tensor], list]:
    """The prompts' prefill and `steps` decode steps of them all, then the first prompt's prefill
    again as a sequence of its own and `steps` decode steps of it alone (its context one run of
    slots: the row path), through `stages` in order: every stage's output of every step, the caches."""
    caches = [cache_for(stage, num_blocks=96) for stage in stages]
    names, new, outs = [f"s{i}" for i in range(len(prompts))], [list(p) for p in prompts], []
    for step in range(2 + 2 * steps):
        if step == 1 + steps:
            names, new = ["alone"], [list(prompts[0])]
        x = torch.tensor([t for ids in new for t in ids])
        for stage, cache in zip(stages, caches, strict=True):
            for name, ids in zip(names, new, strict=True):
                cache.reserve(name, len(ids))
            layout = cache.plan_step(names, [len(ids) for ids in new])
            with torch.no_grad():
                x = stage(x, cache=cache, layout=layout, logit_rows=layout.last_rows())
            outs.append(x)
        new = [[int(row.argmax())] for row in x]
    return outs, caches


@pytest.mark.parametrize("family", ["smollm2", "llama2"])
def test_the_layers_in_one_call_give_the_loops_numbers_to_the_bit(tmp_path, monkeypatch, dtype, family):
    make_tiny_checkpoint(family, tmp_path, vocab_size=256, **SHAPES[family])
    calls, normed = [], []
    real = layer_stack.LayerStack._run

    def counted(self, x, kernels, cache, final):
        calls.append(x.shape[0])
        normed.append(final is not None)
        return real(self, x, kernels, cache, final)

    monkeypatch.setattr(layer_stack.LayerStack, "_run", counted)
    for split in ([LayerRange(0, 4)], [LayerRange(0, 1), LayerRange(1, 4)]):
        calls.clear()
        normed.clear()
        ours, mine = _run(_stages(tmp_path, split, dtype, stack=True), PROMPTS, steps=3)
        # 3 decode steps of the 13 (the decode path) and 3 of one alone (the row path) a stage, the
        # stages in turn; the last stage's calls make the final norm too
        assert calls == [13] * 3 * len(split) + [1] * 3 * len(split)
        assert normed == [i % len(split) == len(split) - 1 for i in range(6 * len(split))]
        theirs, their_caches = _run(_stages(tmp_path, split, dtype, stack=False), PROMPTS, steps=3)
        assert len(calls) == 6 * len(split)  # the loops ran there: no call more
        for got, want in zip(ours, theirs, strict=True):
            assert got.shape == want.shape and torch.equal(got, want), (got.float() - want.float()).abs().max()
        for cache, their_cache in zip(mine, their_caches, strict=True):
            for i in cache.k:
                assert torch.equal(cache.k[i], their_cache.k[i]) and torch.equal(cache.v[i], their_cache.v[i])


def test_it_serves_only_where_every_product_is_the_blocks(tmp_path, dtype):
    make_tiny_checkpoint("smollm2", tmp_path / "fits", vocab_size=256, **SHAPES["smollm2"])
    assert layer_stack.LayerStack.of(load_stage(tmp_path / "fits", LayerRange(0, 4), dtype=dtype)) is not None
    plain = load_stage(tmp_path / "fits", LayerRange(0, 4), dtype=dtype, weight_layout="plain")
    assert layer_stack.LayerStack.of(plain) is None
    # gate_up's 2 x 104 outputs are not whole blocks of 32: oneDNN multiplies it, and the loops run
    make_tiny_checkpoint("smollm2", tmp_path / "odd", vocab_size=256, hidden_size=96, intermediate_size=104)
    odd = load_stage(tmp_path / "odd", LayerRange(0, 4), dtype=dtype)
    assert odd.decode_path is not None and odd.decode_path.stack is None
    assert odd.row_path is not None and odd.row_path.stack is None


def test_it_refuses_rows_and_pools_it_was_not_bound_for(tmp_path, monkeypatch, dtype):
    make_tiny_checkpoint("smollm2", tmp_path, vocab_size=256, **SHAPES["smollm2"])
    seen = []
    real, run = layer_stack.LayerStack.__call__, layer_stack.LayerStack._run

    def kept(self, x, kernels, cache, final):
        seen.append((self, x, kernels, cache))
        return run(self, x, kernels, cache, final)

    monkeypatch.setattr(layer_stack.LayerStack, "_run", kept)
    (stage,) = _stages(tmp_path, [LayerRange(0, 4)], dtype, stack=True)
    _run([stage], PROMPTS[:3], steps=1)
    stack, x, kernels, cache = seen[0]  # a decode step of 3 rows
    loop = decode_path._layers(x, stage.decode_path.layers, kernels, cache, stage.config.rms_norm_eps)
    assert torch.equal(real(stack, x, kernels, cache), loop)  # the same step again, either way
    residual, normed = stack.normed(x, kernels, cache)  # and with the stage's final norm
    assert torch.equal(residual, loop) and torch.equal(normed, stage.norm(loop))
    (first, _) = _stages(tmp_path, [LayerRange(0, 2), LayerRange(2, 4)], dtype, stack=True)
    assert first.decode_path.stack.final_norm is None  # no head, no final norm
    with pytest.raises(ValueError, match="no final norm"):
        first.decode_path.stack.normed(x, kernels, cache)
    with pytest.raises(ValueError, match=r"the stack takes \[3, 96\]"):
        real(stack, x[:2].contiguous(), kernels, cache)
    with pytest.raises(ValueError, match="the stack takes"):
        real(stack, x.to(torch.float16), kernels, cache)
    other = cache_for(load_stage(tmp_path, LayerRange(0, 4), dtype=dtype), num_blocks=8)
    with pytest.raises(ValueError, match=r"layer 0's pools are \[64, 2, 16\] .* not the contiguous \[768, 2, 16\]"):
        real(stack, x, kernels, other)
    wider = tmp_path / "wider"  # SiLU halves of 160: the step's kernels were bound for 128
    make_tiny_checkpoint("smollm2", wider, vocab_size=256, hidden_size=96, intermediate_size=160)
    stack_of_wider = layer_stack.LayerStack.of(load_stage(wider, LayerRange(0, 4), dtype=dtype))
    assert stack_of_wider is not None
    with pytest.raises(ValueError, match=r"bound for \{'heads': 6, 'SiLU width': 128, .*'SiLU width': 160"):
        real(stack_of_wider, x, kernels, cache)
    # Pools are checked when a cache or an address is first seen, not at every step: the refused
    # cache's check left nothing behind, and the first cache serves again; a pool swapped in it
    # since (another address) is checked again, and refused.
    assert torch.equal(real(stack, x, kernels, cache), loop)
    with pytest.raises(ValueError, match=r"layer 0's pools are \[64, 2, 16\]"):
        real(stack, x, kernels, other)
    assert torch.equal(real(stack, x, kernels, cache), loop)
    kept_pool, cache.k[0] = cache.k[0], other.k[0]
    try:
        with pytest.raises(ValueError, match=r"layer 0's pools are \[64, 2, 16\]"):
            real(stack, x, kernels, cache)
    finally:
        cache.k[0] = kept_pool
