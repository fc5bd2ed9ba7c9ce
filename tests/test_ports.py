"""Free ports for launched processes come from outside the range of outgoing connections' ports."""

from __future__ import annotations

import socket
from collections import deque

from layerline.shared import ports


def test_free_ports_are_outside_the_ephemeral_range_and_bindable():
    low, high = ports.ephemeral_range()
    assert 1024 <= low <= high <= 65535
    for count in (1, 3):
        for _ in range(20):
            base = ports.free_port("127.0.0.1", count=count)
            assert not low <= base <= high and not low <= base + count - 1 <= high
            assert base >= ports.LOWEST
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))


def test_a_port_something_listens_on_is_not_handed_out(monkeypatch):
    """With the choice rigged to one port that a socket holds, and then to the next: the next."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        choices = iter([taken, taken + 1])
        monkeypatch.setattr(ports.random.SystemRandom, "randint", lambda self, a, b: next(choices))
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (61000, 61000))
        monkeypatch.setattr(ports, "LOWEST", 1024)
        assert ports.free_port("127.0.0.1") == taken + 1


def test_a_port_is_not_handed_out_twice_before_anything_binds_it():
    """A launcher chooses all of a cluster's ports before any process binds one: 1000 choices in a
    row (about 27,000 ports to choose from, so random choices would meet some 18 times) are all
    different."""
    chosen = [ports.free_port("127.0.0.1") for _ in range(1000)]
    assert len(set(chosen)) == 1000
    runs = [ports.free_port("127.0.0.1", count=3) for _ in range(100)]
    covered = [port for base in runs for port in range(base, base + 3)]
    assert len(set(covered) | set(chosen)) == 1000 + 300


def _fresh(monkeypatch, count: int) -> list[int]:
    """`count` ports free now, and this process's memory of ports handed out emptied (the tests
    above filled it: a rigged choice could meet one of theirs)."""
    chosen = [ports.free_port("127.0.0.1") for _ in range(count)]
    monkeypatch.setattr(ports, "_handed_out", deque(maxlen=ports.REMEMBERED))
    return chosen


def test_a_reserved_port_is_not_handed_out(monkeypatch):
    """A port reserved for a process that has not bound it yet, with the choice rigged to it first."""
    reserved, other = _fresh(monkeypatch, 2)
    choices = iter([reserved, other])
    monkeypatch.setattr(ports.random.SystemRandom, "randint", lambda self, a, b: next(choices))
    ports.reserve(reserved, 0)
    assert ports.free_port("127.0.0.1") == other


def test_up_does_not_hand_its_coordinators_port_to_another_process(monkeypatch, tmp_path):
    """`up --port P` starts its coordinator on P before its stages. The ports it chooses (the
    cluster port, the HTTP API's, each stage's, each health port) are never P nor a metrics port it
    gives, with the first choice rigged to propose P, then a metrics port. Before `reserve`, a stage
    was handed P and failed with "address already in use" once the coordinator bound it (a CI run)."""
    from layerline.launcher import ClusterPlan, LocalCluster

    from .tiny_models import make_tiny_checkpoint

    model = tmp_path / "model"
    make_tiny_checkpoint("smollm2", model)
    metrics = ports.free_port("127.0.0.1", count=5)  # the coordinator's and the 4 stages'
    port, *rest = _fresh(monkeypatch, 1 + 20)
    proposals = iter([port, metrics, metrics + 3, *rest])
    monkeypatch.setattr(ports.random.SystemRandom, "randint", lambda self, a, b: next(proposals))
    plan = ClusterPlan(
        model=str(model),
        port=port,
        stages=2,
        replicas=2,
        layer_ranges=((0, 2), (2, 4)),
        metrics_port=metrics,
        health_ports=True,
        http_port=0,
        log_dir=tmp_path / "run",
    )
    cluster = LocalCluster(plan, model)
    spawned: dict[str, list[str]] = {}
    monkeypatch.setattr(cluster, "_spawn", lambda name, args, env: spawned.setdefault(name, args))
    cluster.start()
    assert cluster.http_port is not None
    chosen = [cluster.http_port, int(cluster.cluster_address.rpartition(":")[2]), *cluster.health_ports.values()]
    chosen += [int(args[args.index("--port") + 1]) for name, args in spawned.items() if name != "coordinator"]
    assert len(spawned) == 5 and len(chosen) == 2 + 5 + 4
    assert len(set(chosen)) == len(chosen)
    assert not set(chosen) & {port, *range(metrics, metrics + 5)}
    assert set(chosen) <= set(rest)
