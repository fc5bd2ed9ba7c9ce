"""Free ports for launched processes come from outside the range of outgoing connections' ports."""

from __future__ import annotations

import socket

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
