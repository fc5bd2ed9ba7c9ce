"""The coordinator's registry and chain building, as plain values."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from layerline.coordinator.registry import Registry, Worker, build_chains
from layerline.shared.errors import InvalidInput, NoCapacity


def w(address: str, start: int, end: int, *, model: str = "m1", instance: str = "i") -> Worker:
    return Worker(
        address=address,
        instance_id=instance,
        model_id=model,
        model_name="x",
        layer_start=start,
        layer_end=end,
        num_layers=30,
    )


def addresses(chains: list[list[Worker]]) -> list[list[str]]:
    return [[x.address for x in c] for c in chains]


def test_chains_cover_all_layers_with_uneven_splits_and_replicas():
    workers = [w("a", 0, 7), w("b", 7, 20), w("c", 20, 30), w("d", 0, 20), w("e", 20, 30), w("f", 0, 10)]
    assert addresses(build_chains(workers, 30)) == [["d", "c"], ["a", "b", "e"]]


def test_workers_of_different_models_are_never_chained():
    assert build_chains([w("a", 0, 15, model="m1"), w("b", 15, 30, model="m2")], 30) == []


def test_surviving_chains_are_kept_when_another_breaks():
    a0, a1, b0, b1 = w("a0", 0, 15), w("a1", 15, 30), w("b0", 0, 15), w("b1", 15, 30)
    before = build_chains([a0, a1, b0, b1], 30)
    assert addresses(before) == [["a0", "a1"], ["b0", "b1"]]
    # a1 dies: b's chain stays exactly as it was; a0 has no partner left
    assert addresses(build_chains([a0, b0, b1], 30, keep=before)) == [["b0", "b1"]]
    # without `keep`, a rebuild would have taken a0 and broken b's chain
    assert addresses(build_chains([a0, b0, b1], 30)) == [["a0", "b1"]]


def test_only_probed_workers_are_routable_and_a_failed_probe_removes_one():
    reg = Registry(num_layers=30)
    first, second = w("a", 0, 15), w("b", 15, 30)
    reg.register(first)
    reg.register(second)
    assert reg.routable() == [] and [x.address for x in reg.due_for_probe(every=60)] == ["a", "b"]
    reg.probed(first, ready=True)
    reg.probed(second, ready=True)
    assert [x.address for x in reg.routable()] == ["a", "b"] and reg.due_for_probe(every=60) == []
    version = reg.version
    reg.probed(second, ready=False)
    assert [x.address for x in reg.routable()] == ["a"] and reg.version == version + 1
    assert reg.register(w("b", 15, 30, instance="restarted")) is False  # a new process at the same address
    assert [x.address for x in reg.routable()] == ["a"]
    assert reg.register(w("a", 0, 15)) is True  # the same process again (it missed a heartbeat)
    assert [x.address for x in reg.routable()] == ["a"]


def test_heartbeats_of_unknown_instances_ask_to_register_again():
    reg = Registry(num_layers=30)
    assert reg.heartbeat(w("a", 0, 15)) is False
    reg.register(w("a", 0, 15))
    assert reg.heartbeat(w("a", 0, 15)) is True
    assert reg.heartbeat(w("a", 0, 15, instance="other")) is False


def test_a_worker_of_another_layer_count_is_refused():
    with pytest.raises(ValueError, match="serves a model of 32 layers; this coordinator's model has 30"):
        Registry(num_layers=30).register(
            Worker(
                address="a", instance_id="i", model_id="m", model_name="x", layer_start=0, layer_end=16, num_layers=32
            )
        )


def test_the_registry_holds_at_most_max_workers_addresses():
    reg = Registry(num_layers=30, max_workers=2)
    reg.register(w("a", 0, 15))
    reg.register(w("b", 15, 30))
    with pytest.raises(NoCapacity, match="max_workers = 2"):
        reg.register(w("c", 0, 30))
    assert [x.address for x in reg.workers()] == ["a", "b"]
    assert reg.register(w("a", 0, 15, instance="restarted")) is False  # a known address may come back
    reg.remove("b")
    reg.register(w("c", 0, 30))
    assert [x.address for x in reg.workers()] == ["a", "c"]


def test_a_full_registry_makes_room_by_expiring_silent_workers():
    reg = Registry(num_layers=30, expiry=0.05, max_workers=1)
    reg.register(w("a", 0, 30))
    time.sleep(0.1)
    reg.register(w("b", 0, 30))
    assert [x.address for x in reg.workers()] == ["b"]


@pytest.mark.parametrize("field", ["address", "instance_id", "model_id", "model_name", "host", "device", "dtype"])
def test_a_worker_field_past_its_length_bound_is_refused(field):
    reg = Registry(num_layers=30)
    with pytest.raises(InvalidInput, match=rf"worker\.{field}: 257 characters; at most 256"):
        reg.register(replace(w("a", 0, 30), **{field: "x" * 257}))
    reg.register(w("a", 0, 30))
    with pytest.raises(InvalidInput, match=rf"worker\.{field}"):
        reg.heartbeat(replace(w("a", 0, 30), **{field: "x" * 257}))
    assert reg.workers() == [w("a", 0, 30)]
