"""A step's setup before its layers: the kernels' numbers checked as Python numbers, the rotary
rows of one run a slice of the table, a lone token's embedding a view, inference mode entered once.
Each must give what the slower way gave, to the bit, and refuse what it refused."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from layerline.shared.model_config import LayerRange
from layerline.stage_worker import kernel_args
from layerline.stage_worker.compute import ComputeThread, stay_in_inference_mode
from layerline.stage_worker.engine import SequenceStep, StageEngine
from layerline.stage_worker.kv_cache import CacheShape, PagedKVCache
from layerline.stage_worker.weights import load_stage

from .tiny_models import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("setup")
    make_tiny_checkpoint("smollm2", path)
    return path


def _outcome(make):
    try:
        return make()
    except ValueError as e:
        return str(e)


@settings(max_examples=200, deadline=None)
@given(
    tables=st.lists(st.lists(st.integers(-2, 9), min_size=0, max_size=4), min_size=0, max_size=4),
    lens=st.lists(st.integers(-1, 20), min_size=0, max_size=4),
    block=st.integers(1, 4),
)
def test_python_numbers_are_checked_as_the_tensors_are(tables, lens, block):
    """`decode_batch` of Python numbers refuses what the tensors' check refuses, with the same
    message, and gives the same tensors (rows padded with block 0) where it accepts (a table and a
    length a row; mismatched counts below)."""
    lens = (lens + [1] * len(tables))[: len(tables)]
    width = max(map(len, tables), default=0)
    padded = torch.tensor([[*t, *[0] * (width - len(t))] for t in tables], dtype=torch.int64).view(len(tables), width)
    from_tensors = _outcome(lambda: kernel_args.decode_batch(padded, torch.tensor(lens), block=block, slots=8 * block))
    from_numbers = _outcome(lambda: kernel_args.decode_batch(tables, lens, block=block, slots=8 * block))
    if isinstance(from_tensors, str):
        assert from_numbers == from_tensors
        return
    assert isinstance(from_numbers, kernel_args.DecodeBatch)
    assert torch.equal(from_numbers.tables, from_tensors.tables) and from_numbers.tables.dtype == torch.int64
    assert torch.equal(from_numbers.lens, from_tensors.lens)


@settings(max_examples=100, deadline=None)
@given(slots=st.lists(st.integers(-3, 12), max_size=6))
def test_write_slots_of_python_numbers_are_checked_as_the_tensors_are(slots):
    from_tensors = _outcome(lambda: kernel_args.write_slots(torch.tensor(slots, dtype=torch.int64), pool_slots=10))
    from_numbers = _outcome(lambda: kernel_args.write_slots(slots, pool_slots=10))
    if isinstance(from_tensors, str):
        assert from_numbers == from_tensors
    else:
        assert isinstance(from_numbers, kernel_args.WriteSlots) and torch.equal(from_numbers.slots, from_tensors.slots)


def test_mismatched_tables_and_lengths_are_refused_naming_both():
    for tables, lens in (([[0], [1]], [1]), (torch.tensor([[0], [1]]), torch.tensor([1]))):
        with pytest.raises(ValueError, match=r"block tables \(2, 1\) and lengths \(1,\) do not match"):
            kernel_args.decode_batch(tables, lens, block=4, slots=16)
    with pytest.raises(ValueError, match=r"block tables \(2, 1\) and lengths \(2,\) do not match"):
        kernel_args.decode_batch([[0]], [1, 2], block=4, slots=16, table_of=[0, 1])  # no second table


def test_a_sequences_table_serves_each_of_its_rows():
    """`table_of`: a sequence's table checked and padded once, then read by each of its rows (a
    prompt's tokens, drafted tokens), as the tensors indexed by row give it."""
    tables, lens, table_of = [[4, 5, 6], [2]], [9, 10, 11, 3], [0, 0, 0, 1]
    batch = kernel_args.decode_batch(tables, lens, block=4, slots=32, table_of=table_of)
    assert batch.tables.tolist() == [[4, 5, 6], [4, 5, 6], [4, 5, 6], [2, 0, 0]]
    assert batch.lens.tolist() == lens
    with pytest.raises(ValueError, match=r"decode lengths must lie in 1\.\.12"):
        kernel_args.decode_batch(tables, [9, 10, 13, 3], block=4, slots=32, table_of=table_of)
    with pytest.raises(ValueError, match=r"block ids must lie in 0\.\.5"):
        kernel_args.decode_batch(tables, lens, block=4, slots=24, table_of=table_of)


def test_a_layout_carries_its_kernel_arguments_checked_against_its_pools():
    """plan_step hands the kernels the numbers they read, checked against its own pools; the
    positions and decode rows, made at their first use, are what the step's numbers say."""
    cache = PagedKVCache(CacheShape(12, 4, 1, 8), layer_ids=[0], dtype=torch.float32)
    for sid, n in (("a", 6), ("b", 3)):
        cache.reserve(sid, n)
        cache.plan_step([sid], [n])
    cache.reserve("a", 1), cache.reserve("b", 3)
    layout = cache.plan_step(["a", "b"], [1, 3], drafts=[0, 2])
    batch, writes = layout.memo["decode_batch"], layout.memo["write_slots"]
    checked = kernel_args.decode_batch(layout.decode_blocks, layout.decode_lens, block=4, slots=48)
    assert isinstance(batch, kernel_args.DecodeBatch) and batch.slots == 48
    assert torch.equal(batch.tables, checked.tables) and torch.equal(batch.lens, checked.lens)
    assert isinstance(writes, kernel_args.WriteSlots) and writes.pool_slots == 48
    assert torch.equal(writes.slots, layout.write_slots)
    assert layout.positions.tolist() == [6, 3, 4, 5] and layout.num_tokens == 4
    assert layout.positions_run is None
    assert layout.decode_rows.tolist() == [0, 1, 2, 3]  # a's token, then b's three: each a decode row
    assert layout.decode_lens.tolist() == [7, 4, 5, 6]
    cache.reserve("a", 1)
    alone = cache.plan_step(["a"], [1])
    assert alone.positions_run == range(7, 8) and alone.positions.tolist() == [7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotary_rows_of_a_run_are_the_indexed_rows_as_a_view(ckpt, dtype):
    model = load_stage(ckpt, LayerRange(0, 1))
    for run in (range(1), range(5, 9), range(1023, 1025), range(3000, 3001), range(4, 4)):
        at = torch.tensor(list(run), dtype=torch.long)
        indexed = model.rope(at, dtype)
        sliced = model.rope(at, dtype, run=run)
        assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(indexed, sliced))
        if len(run):
            table = model._rope_tables[dtype]
            assert sliced[0].data_ptr() == table[1][run.start].data_ptr()  # a slice: nothing copied
            assert sliced[1].data_ptr() == table[2][run.start].data_ptr()


@pytest.mark.parametrize("layout", ["both", "packed", "plain"])
def test_a_lone_tokens_embedding_is_its_row_and_no_step_changes_it(ckpt, layout):
    """A lone token's rows are a view of the embedding: they equal the embedding's, and decoding
    through every path a single row may take (the layers in C, the row path, the modules) leaves
    the weight exactly as loaded."""
    model = load_stage(ckpt, LayerRange(0, 4), weight_layout=layout)
    cfg = model.config
    cache = PagedKVCache(
        CacheShape(32, 4, cfg.num_kv_heads, cfg.head_dim), layer_ids=LayerRange(0, 4), dtype=torch.float32
    )
    engine = StageEngine(model, cache)
    assert model.embed_tokens is not None
    weight = model.embed_tokens.weight
    loaded = weight.detach().clone()
    for token in (0, 7, cfg.vocab_size - 1):
        row = model.embed([token])
        assert row.data_ptr() == weight[token].data_ptr()
        assert torch.equal(row, F.embedding(torch.tensor([token]), weight))
    assert torch.equal(model.embed([3, 4]), weight[3:5])  # several: the embedding's own call
    with pytest.raises(IndexError):
        model.embed([cfg.vocab_size])
    prompt = [1, 5, 9, 30]
    out = engine.run([SequenceStep("s", tuple(range(4)), tuple(prompt))])
    token = out.draws["s"].token_id
    for position in range(4, 12):
        out = engine.run([SequenceStep("s", (position,), (token,))])
        token = out.draws["s"].token_id
    assert engine.steps_computed == 9 and not out.errors
    assert torch.equal(weight.detach(), loaded)


def test_a_step_runs_in_inference_mode_and_leaves_its_callers_thread_as_it_was(ckpt):
    model = load_stage(ckpt, LayerRange(0, 2))
    cfg = model.config
    cache = PagedKVCache(
        CacheShape(16, 4, cfg.num_kv_heads, cfg.head_dim), layer_ids=LayerRange(0, 2), dtype=torch.float32
    )
    engine = StageEngine(model, cache)
    out = engine.run([SequenceStep("s", (0, 1), (3, 4))])
    assert out.hidden is not None and out.hidden.is_inference()
    assert not torch.is_inference_mode_enabled()

    thread = ComputeThread("test-compute")
    try:
        before = thread.submit(torch.is_inference_mode_enabled).result(timeout=30)
        thread.submit(stay_in_inference_mode).result(timeout=30)
        after = thread.submit(torch.is_inference_mode_enabled).result(timeout=30)
        stepped = thread.submit(engine.run, [SequenceStep("s", (2,), (5,))]).result(timeout=30)
    finally:
        thread.shutdown()
    assert (before, after) == (False, True)
    assert stepped.hidden is not None and stepped.hidden.is_inference() and not stepped.errors
    assert threading.current_thread() is threading.main_thread() and not torch.is_inference_mode_enabled()
