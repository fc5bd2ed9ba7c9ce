"""Orphaned KV: what no step touched for `--orphan-ttl` seconds is freed, on the engine with a
fake clock, and by a real stage worker whose coordinator was SIGKILLed mid-generation."""

from __future__ import annotations

import math
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from layerline.coordinator.members import worker_info, worker_of
from layerline.protos.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc
from layerline.shared.errors import InvalidInput
from layerline.shared.model_config import LayerRange
from layerline.stage_worker.engine import SequenceStep, StageEngine
from layerline.stage_worker.kv_cache import CacheShape, PagedKVCache
from layerline.stage_worker.orphans import free_untouched
from layerline.stage_worker.settings import StageSettings
from layerline.stage_worker.weights import load_stage

from .stage_client import free_port, free_ports
from .tiny_models import make_tiny_checkpoint, write_byte_tokenizer

TTL = 2.0  # the real stage's --orphan-ttl, in seconds


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


def test_the_ttl_flag_is_checked():
    assert StageSettings(model="m", layers="0:1").orphan_ttl == 300.0
    assert StageSettings(model="m", layers="0:1", orphan_ttl=0).orphan_ttl == 0  # never
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"--orphan-ttl .* must be a finite number of seconds"):
            StageSettings(model="m", layers="0:1", orphan_ttl=bad)


def test_the_coordinators_registry_carries_a_stages_ttl():
    info = common_pb2.WorkerInfo(address="a:1", layer_end=4, num_layers=4, dtype="FLOAT32", orphan_ttl_seconds=2.5)
    assert worker_of(info).orphan_ttl == 2.5
    assert worker_info(worker_of(info)).orphan_ttl_seconds == 2.5
    assert worker_of(common_pb2.WorkerInfo(address="a:1", num_layers=4)).orphan_ttl == 0.0  # an older stage: never
    for bad in (-1.0, math.inf, math.nan):
        info.orphan_ttl_seconds = bad
        with pytest.raises(InvalidInput, match=r"worker\.orphan_ttl_seconds"):
            worker_of(info)


def _orphans_freed(port: int, reason: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "layerline_stage_orphans_freed_total" and s.labels.get("reason") == reason
    )


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_a_stage_frees_what_a_sigkilled_coordinator_left_after_its_ttl(checkpoint, tmp_path):
    from layerline.client import Client
    from layerline.launcher import ClusterPlan, LocalCluster

    plan = ClusterPlan(
        model=str(checkpoint),
        layer_ranges=((0, 4),),
        port=free_port(),
        log_dir=tmp_path,
        kv_memory="4M",
        threads=1,
        stage_args=("--orphan-ttl", f"{TTL:g}"),
        metrics_port=free_ports(2),
    )
    cluster = LocalCluster(plan, checkpoint)
    cluster.start()
    try:
        status = cluster.wait_ready(timeout=120)
        with grpc.insecure_channel(cluster.address) as channel:
            reported = coordinator_pb2_grpc.CoordinatorStub(channel).ClusterStatus(
                coordinator_pb2.ClusterStatusRequest(), timeout=10
            )
        assert [w.worker.orphan_ttl_seconds for w in reported.workers] == [TTL]  # the coordinator knows the TTL
        (worker,) = status.workers
        coordinator = dict(cluster.procs)["coordinator"]
        with Client(cluster.address) as client:
            for _ in client.stream("Once upon a time", max_tokens=200, temperature=0.0):
                coordinator.send_signal(signal.SIGKILL)  # mid-generation: nobody will release its KV
                killed = time.monotonic()
                break
        assert coordinator.wait(30) == -signal.SIGKILL
        with grpc.insecure_channel(worker.address) as channel:
            stage = stage_pb2_grpc.StageWorkerStub(channel)

            def info() -> common_pb2.WorkerInfo:
                return stage.Info(stage_pb2.InfoRequest(), timeout=10).worker

            held = info()
            assert held.active_sequences == 1 and held.kv_blocks_free < held.kv_blocks_total
            while (now := info()).active_sequences and time.monotonic() - killed < TTL + 10:
                time.sleep(0.05)
            freed_after = time.monotonic() - killed
        assert (now.active_sequences, now.kv_blocks_free) == (0, now.kv_blocks_total)
        # Its last step ran just before the kill; a sweep every TTL/4 frees it once the TTL is past.
        assert TTL / 2 <= freed_after <= TTL + 5, freed_after
        assert _orphans_freed(cluster.metrics_ports["stage-r0-0-4"], "ttl") == 1
    finally:
        cluster.stop()
    log = (tmp_path / "stage-r0-0-4.log").read_text()
    assert f"freed 1 sequence(s) that no step touched for {TTL:g}s (--orphan-ttl)" in log
