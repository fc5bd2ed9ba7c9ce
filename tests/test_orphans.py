"""Orphaned KV: what no step touched for `--orphan-ttl` seconds is freed, on the engine with a
fake clock, and by a real stage worker whose coordinator was SIGKILLed mid-generation."""

from __future__ import annotations

import math

import pytest

from layerline.coordinator.members import worker_info, worker_of
from layerline.protos.v1 import common_pb2
from layerline.shared.errors import InvalidInput


def test_the_coordinators_registry_carries_a_stages_ttl():
    info = common_pb2.WorkerInfo(address="a:1", layer_end=4, num_layers=4, dtype="FLOAT32", orphan_ttl_seconds=2.5)
    assert worker_of(info).orphan_ttl == 2.5
    assert worker_info(worker_of(info)).orphan_ttl_seconds == 2.5
    assert worker_of(common_pb2.WorkerInfo(address="a:1", num_layers=4)).orphan_ttl == 0.0  # an older stage: never
    for bad in (-1.0, math.inf, math.nan):
        info.orphan_ttl_seconds = bad
        with pytest.raises(InvalidInput, match=r"worker\.orphan_ttl_seconds"):
            worker_of(info)
