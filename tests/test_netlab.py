"""The test hosts themselves: namespaces on a bridge, the relay's delay, a cut link, a clean exit."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from layerline.bench.netlab import _BLAST, _ECHO, _PING, _SINK, NetLab, unavailable

REASON = unavailable()
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(REASON is not None, reason=f"no test hosts on this machine: {REASON}"),
]


def _median_ms(lab: NetLab, host, address: str) -> float:  # type: ignore[no-untyped-def]
    done = lab.run(host, [sys.executable, "-c", _PING, *address.split(":")], timeout=60)
    assert done.returncode == 0, done.stderr
    return float(re.search(r"median round trip ([\d.]+) ms", done.stdout).group(1))  # type: ignore[union-attr]


def test_the_relay_adds_its_delay_each_way_and_little_else() -> None:
    with NetLab() as lab:
        a, b = lab.host("a"), lab.host("b")
        lab.popen(b, [sys.executable, "-c", _ECHO, b.address, "7000"])
        direct = lab.relay([(b, 7000, 0.0)])[0]  # the same path, with no delay
        assert _median_ms(lab, a, f"{b.address}:7000") < 5
        plain = _median_ms(lab, a, direct)
        (delayed,) = lab.relay([(b, 7000, 5.0)])
        slow = _median_ms(lab, a, delayed)
    print(f"round trips: through the relay {plain:.2f} ms, with 5 ms each way {slow:.2f} ms")
    assert slow - plain >= 2 * 5.0 * 0.98  # both directions wait out the delay
    assert slow - plain <= 2 * 5.0 + 5.0  # and the relay adds little beyond it


def test_a_shaped_link_carries_its_rate_and_no_more() -> None:
    with NetLab() as lab:
        a, b = lab.host("a", rate_mbit=20), lab.host("b", rate_mbit=20)
        lab.popen(b, [sys.executable, "-c", _SINK, b.address, "7000"])
        time.sleep(0.3)
        size = 4 << 20  # 1.7 s at 20 Mbit/s: the burst (64 KiB) is a small part of it
        done = lab.run(a, [sys.executable, "-c", _BLAST, b.address, "7000", str(size)], timeout=60)
    assert done.returncode == 0, done.stderr
    rate = float(re.search(r"rate ([\d.]+) Mbit/s", done.stdout).group(1))  # type: ignore[union-attr]
    print(f"4 MiB over a 20 Mbit/s link: {rate:.1f} Mbit/s")
    assert 20 * 0.5 <= rate <= 20 * 1.1


def test_a_cut_link_goes_silent_and_mends() -> None:
    with NetLab() as lab:
        a, b = lab.host("a"), lab.host("b")
        assert lab.reachable(a, b)
        lab.cut(b)
        assert not lab.reachable(a, b, timeout=1.0)
        lab.mend(b)
        assert lab.reachable(a, b)


def test_closing_the_lab_removes_everything_it_made() -> None:
    lab = NetLab()
    try:
        lab.host("a", rate_mbit=100)
        lab.popen(lab.hosts["a"], ["sleep", "60"])
        made = [ns for ns in _namespaces() if ns.startswith(f"ll{lab.tag}-")]
        assert sorted(made) == sorted([f"ll{lab.tag}-a", f"ll{lab.tag}-switch"])
        with pytest.raises(RuntimeError):
            lab.host("a")  # the same name again: `ip netns add` refuses, and says so
    finally:
        lab.close()
    assert not [ns for ns in _namespaces() if ns.startswith(f"ll{lab.tag}-")]
    assert all(p.poll() is not None for p in lab.processes)


def _namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]
