"""The measured cost of a decode step (stage_worker/step_cost.py) and the split `up` makes of it."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from layerline.launcher import STEP_COSTS, ClusterPlan, LocalCluster, measured_step_cost, split_layers
from layerline.shared.model_config import ModelConfig
from layerline.stage_worker.step_cost import measure

from .tiny_models import make_tiny_checkpoint

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """Two models alike but for the vocabulary: a head of 211 rows, and one of 32768."""
    small, large = tmp_path_factory.mktemp("small-head"), tmp_path_factory.mktemp("large-head")
    make_tiny_checkpoint("llama3", small, num_layers=6, hidden_size=128, vocab_size=211)
    make_tiny_checkpoint("llama3", large, num_layers=6, hidden_size=128, vocab_size=32768)
    return small, large


def test_a_larger_head_weighs_more_layers(heads):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        small, large = (measure(ModelConfig.from_checkpoint(p), rows=8, dtype=torch.float32) for p in heads)
    finally:
        torch.set_num_threads(before)
    assert (small.rows, small.threads) == (8, 1)
    assert small.layer_ms > 0 and large.layer_ms > 0
    # 32768 x 128 is 84 MB of float32 a step against 0.1 MB of a layer: far more than the small one's.
    assert large.head_weight > small.head_weight + 1


def test_measuring_needs_three_layers(tmp_path):
    make_tiny_checkpoint("llama3", tmp_path, num_layers=2)
    with pytest.raises(ValueError, match="3 layers or more; the model has 2"):
        measure(ModelConfig.from_checkpoint(tmp_path), dtype=torch.float32)


def test_up_splits_where_the_measured_head_puts_it(heads, tmp_path, monkeypatch):
    _, large = heads
    monkeypatch.setenv("LAYERLINE_HOME", str(tmp_path / "home"))
    cost = measured_step_cost(large, threads=1, dtype="float32")  # the process `up` runs
    assert cost["threads"] == 1 and cost["rows"] == 16 and cost["head_weight"] > 1
    kept = json.loads((tmp_path / "home" / STEP_COSTS).read_text())
    assert list(kept.values()) == [cost]
    with monkeypatch.context() as m:  # measured once per machine: the second ask runs nothing
        m.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"measured again: {a}"))
        assert measured_step_cost(large, threads=1, dtype="float32") == cost
    cluster = LocalCluster(ClusterPlan(model=str(large), stages=2, log_dir=tmp_path / "m"), large)
    assert cluster.split_note.startswith("measured on 1 thread(s), 16 sequences a step")
    assert f"at {cost['measured_at']}; kept in {tmp_path / 'home' / STEP_COSTS}" in cluster.split_note
    assert cluster.ranges == split_layers(6, 2, head_weight=cluster.head_weight)
    by_bytes = LocalCluster(ClusterPlan(model=str(large), stages=2, split="weights", log_dir=tmp_path / "w"), large)
    assert by_bytes.split_note == ""
    assert by_bytes.ranges == split_layers(6, 2, head_weight=ModelConfig.from_checkpoint(large).head_weight)
    with pytest.raises(ValueError, match="split 'even' is not one of measured, weights"):
        LocalCluster(ClusterPlan(model=str(large), stages=2, split="even", log_dir=tmp_path / "e"), large)
