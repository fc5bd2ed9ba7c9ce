"""Orphaned KV: what no step touched for `--orphan-ttl` seconds is freed, on the engine with a
fake clock, and by a real stage worker whose coordinator was SIGKILLed mid-generation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from layerline.coordinator.members import worker_info, worker_of
from layerline.protos.v1 import common_pb2
from layerline.shared.errors import InvalidInput
from layerline.shared.model_config import LayerRange
from layerline.stage_worker.engine import SequenceStep, StageEngine
from layerline.stage_worker.kv_cache import CacheShape, PagedKVCache
from layerline.stage_worker.orphans import free_untouched
from layerline.stage_worker.weights import load_stage

from .tiny_models import make_tiny_checkpoint, write_byte_tokenizer


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random SmolLM2-shaped model of 4 layers, with a byte-level tokenizer."""
    path = tmp_path_factory.mktemp("tiny-orphans")
    make_tiny_checkpoint("smollm2", path, num_layers=4, vocab_size=259)
    assert write_byte_tokenizer(path) == 259
    return path


def test_the_sweep_frees_only_what_no_step_touched_for_longer_than_the_ttl(checkpoint):
    model = load_stage(checkpoint, LayerRange(0, 2))
    cfg = model.config
    cache = PagedKVCache(CacheShape(32, 4, cfg.num_kv_heads, cfg.head_dim), layer_ids=range(2), dtype=torch.float32)
    clock = FakeClock()
    engine = StageEngine(model, cache, clock=clock)
    prompt = (1, 5, 9, 30, 31, 40)
    first = engine.run(
        [
            SequenceStep("lender", tuple(range(6)), prompt),
            SequenceStep("orphan", tuple(range(6)), prompt),
            SequenceStep("decoding", tuple(range(6)), prompt),
            SequenceStep("refused", tuple(range(6)), prompt),
            SequenceStep("\x00scratch", (0,), (1,)),  # a probe's scratch sequence is never swept
        ]
    )
    assert not first.errors
    clock.now = 130.0
    later = engine.run(
        [
            SequenceStep("decoding", (6,), (7,)),  # a sequence of the step
            SequenceStep("borrower", (4, 5), (31, 40), prefix_from="lender"),  # touches its lender too
            SequenceStep("refused", (9,), (7,)),  # named, though it cannot run: its positions skip
        ]
    )
    assert [e.sequence_id for e in later.errors] == ["refused"]
    clock.now = 160.0  # "orphan" untouched for exactly the TTL: not longer
    assert free_untouched(engine, 60.0) == []
    used = cache.blocks_total - cache.blocks_free
    clock.now = 160.5
    assert free_untouched(engine, 60.0) == ["orphan"]
    assert sorted(cache.sequences()) == ["\x00scratch", "borrower", "decoding", "lender", "refused"]
    assert cache.blocks_total - cache.blocks_free == used - 2  # its 6 tokens' 2 blocks are back
    clock.now = 190.5
    assert sorted(free_untouched(engine, 60.0)) == ["borrower", "decoding", "lender", "refused"]
    assert cache.sequences() == ["\x00scratch"]
    assert free_untouched(engine, 60.0) == []


def test_the_coordinators_registry_carries_a_stages_ttl():
    info = common_pb2.WorkerInfo(address="a:1", layer_end=4, num_layers=4, dtype="FLOAT32", orphan_ttl_seconds=2.5)
    assert worker_of(info).orphan_ttl == 2.5
    assert worker_info(worker_of(info)).orphan_ttl_seconds == 2.5
    assert worker_of(common_pb2.WorkerInfo(address="a:1", num_layers=4)).orphan_ttl == 0.0  # an older stage: never
    for bad in (-1.0, math.inf, math.nan):
        info.orphan_ttl_seconds = bad
        with pytest.raises(InvalidInput, match=r"worker\.orphan_ttl_seconds"):
            worker_of(info)
