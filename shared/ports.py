"""Free TCP ports for the processes a launcher starts, chosen where no outgoing connection lands.

A port found free by binding port 0 comes from the kernel's ephemeral range, the same range the
kernel takes the source ports of outgoing connections from. Between finding it and the server
binding it, a gRPC channel of any process on the machine can take it as its source port, and the
server then fails with "address already in use" (seen in the test suite). So ports are chosen at
random below that range, where only a listener can be, and checked by binding them. A port this
process handed out is not handed out again (among its last `REMEMBERED`): a launcher chooses every
port of a cluster before any process binds one, and two random choices can meet (a coordinator's
health port and a stage's port did, failing a CI run). Nor is a port `reserve`d, remembered the
same way until its process binds it: one a user gave (`up --port P` starts its coordinator on P,
and a stage was once handed P before the coordinator had bound it, failing a CI run).

Knows nothing of what listens on them.
"""

from __future__ import annotations

import random
import socket
from collections import deque
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # below this, ports that other services are known to listen on
TRIES = 200
REMEMBERED = 4096  # ports this process handed out or reserved that it does not hand out again

_handed_out: deque[int] = deque(maxlen=REMEMBERED)


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections (Linux's default elsewhere)."""
    try:
        low, high = (int(part) for part in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def reserve(*ports: int) -> None:
    """Mark `ports` as taken by a process that will listen on them: `free_port` does not hand
    them out (0, the kernel's choice, is ignored)."""
    _handed_out.extend(port for port in ports if port)


def free_port(host: str = "127.0.0.1", *, count: int = 1) -> int:
    """The first of `count` consecutive ports on `host` that nothing listens on now, outside the
    ephemeral range where the kernel can. Raises OSError when none is found."""
    low, high = ephemeral_range()
    spans = [(a, b) for a, b in ((LOWEST, low - 1), (high + 1, 65535)) if b - a + 1 >= count]
    rng = random.SystemRandom()
    for _ in range(TRIES if spans else 0):
        start, end = rng.choice(spans)
        base = rng.randint(start, end - count + 1)
        chosen = range(base, base + count)
        if not any(port in _handed_out for port in chosen) and all(_bindable(host, port) for port in chosen):
            _handed_out.extend(chosen)
            return base
    if count == 1:  # no room outside the ephemeral range (a machine configured so): the kernel's choice
        with socket.socket() as s:
            s.bind((host, 0))
            return int(s.getsockname()[1])
    raise OSError(f"no {count} consecutive free ports on {host}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
