"""Test hosts on real links: network namespaces joined through a bridge, with a rate and a delay.

    sudo python -m layerline.bench.netlab demo                       # two hosts, a relay, round trips
    sudo python -m layerline.bench.netlab hosts coord,s0,s1 --rate 1000 --relay s1:7100:5
                                                                    # keep hosts until Ctrl-C

Owns `NetLab`, which makes (as root, with `ip` and `tc`):
- a switch: a namespace holding one bridge, so nothing is added to the machine's own network;
- hosts: one namespace each, joined to the bridge by a veth pair, with an address of the lab's
  /24 and, when asked, a rate (`tbf` on both ends of the pair: each direction is shaped);
- a relay host (`relay.py`) for delay, which these kernels cannot add (no `sch_netem`): a member
  dials the relay's port for a peer and every byte reaches it one delay later, each direction;
- processes started inside a host, and cutting a host's link (`ip link set down`) and mending it.
Everything it made is removed by `close()` (a context manager's exit, so also when a test fails).
Addresses stay inside the namespaces it made; nothing else is contacted. `unavailable()` says why
a machine cannot run it (not root, no `ip`, namespaces refused), for tests to skip with.
"""

from __future__ import annotations

import argparse
import itertools
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import IO

from .relay import Route

RELAY_PORTS = itertools.count(20000)
RELAY_START_SECONDS = 30.0
TBF_PROBE = ("rate", "100mbit", "burst", "64k", "latency", "100ms")  # what unavailable() tries


@dataclass(frozen=True)
class Host:
    name: str
    namespace: str
    address: str  # on the lab's bridge
    interface: str  # its end of the veth pair (inside `namespace`)


@dataclass
class NetLab:
    """Hosts on one bridge; close it (or use it as a context manager) to remove everything."""

    subnet: str = "10.77.0"  # the lab's /24
    tag: str = field(default_factory=lambda: secrets.token_hex(2))  # keeps labs apart, names short
    hosts: dict[str, Host] = field(default_factory=dict)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    relay_host: Host | None = None
    relay_routes: list[Route] = field(default_factory=list)
    _relay: subprocess.Popen[bytes] | None = None
    _switch: str = ""

    def __post_init__(self) -> None:
        self._switch = f"ll{self.tag}-switch"
        _ip("netns", "add", self._switch)
        try:
            _ip("-n", self._switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self._switch, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def host(self, name: str, *, rate_mbit: float | None = None) -> Host:
        """A new host on the bridge, its link shaped to `rate_mbit` each way when given."""
        index = len(self.hosts) + 1
        namespace, inside, outside = f"ll{self.tag}-{name}", f"v{self.tag}h{index}", f"v{self.tag}s{index}"
        host = Host(name, namespace, f"{self.subnet}.{index}", inside)
        _ip("netns", "add", namespace)
        self.hosts[name] = host  # from here on, close() removes it
        _ip("link", "add", inside, "netns", namespace, "type", "veth", "peer", "name", outside, "netns", self._switch)
        _ip("-n", namespace, "addr", "add", f"{host.address}/24", "dev", inside)
        for link in (inside, "lo"):
            _ip("-n", namespace, "link", "set", link, "up")
        _ip("-n", self._switch, "link", "set", outside, "master", "br0")
        _ip("-n", self._switch, "link", "set", outside, "up")
        if rate_mbit is not None:
            self.shape(host, rate_mbit)
        return host

    def shape(self, host: Host, rate_mbit: float) -> None:
        """Limit `host`'s link to `rate_mbit` in each direction (`tbf` on both ends of its pair)."""
        index = list(self.hosts).index(host.name) + 1
        # A burst of a few ms of the rate, at least a jumbo frame: tbf needs one whole packet.
        burst = max(int(rate_mbit * 1e6 / 8 * 0.004), 64 << 10)
        for namespace, device in ((host.namespace, host.interface), (self._switch, f"v{self.tag}s{index}")):
            command = ["tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", "tbf"]
            _run([*command, "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms"])

    def relay(self, routes: Sequence[tuple[Host, int, float]]) -> list[str]:
        """Start (or restart) the relay: for each (host, port, one-way delay in ms) the address to
        dial instead of `host:port`. Connections open through the relay before are cut."""
        if self.relay_host is None:
            self.relay_host = self.host("relay")
        self.relay_routes = [Route(next(RELAY_PORTS), h.address, port, delay / 1000) for h, port, delay in routes]
        if self._relay is not None:
            _stop_all([self._relay])
            self.processes.remove(self._relay)
        self._relay = self.popen(
            self.relay_host,
            [sys.executable, "-m", "layerline.bench.relay", self.relay_host.address, *map(str, self.relay_routes)],
            stdout=subprocess.PIPE,
        )
        assert self._relay.stdout is not None
        ready = _line_within(self._relay.stdout, RELAY_START_SECONDS)  # it prints once every port listens
        if not ready.startswith(b"relay on"):
            raise RuntimeError(f"the relay did not start (status {self._relay.poll()}): {ready!r}")
        return [f"{self.relay_host.address}:{r.port}" for r in self.relay_routes]

    def command(self, host: Host, argv: Sequence[str]) -> list[str]:
        """`argv` as run inside `host`."""
        return ["ip", "netns", "exec", host.namespace, *argv]

    def popen(self, host: Host, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """Start `argv` inside `host`; stopped by `close()` if still running."""
        process = subprocess.Popen(self.command(host, argv), **kwargs)  # type: ignore[call-overload]
        self.processes.append(process)
        return process

    def run(self, host: Host, argv: Sequence[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside `host` to its end; its output as text."""
        return subprocess.run(self.command(host, argv), capture_output=True, text=True, timeout=timeout)

    def cut(self, host: Host) -> None:
        """Take `host`'s link down: its peers hear nothing more, and no error, from it."""
        _ip("-n", host.namespace, "link", "set", host.interface, "down")

    def mend(self, host: Host) -> None:
        _ip("-n", host.namespace, "link", "set", host.interface, "up")

    def reachable(self, source: Host, target: Host, *, timeout: float = 2.0) -> bool:
        """Whether a TCP connection from `source` to `target` gets any answer within `timeout`
        (a refusal is an answer: no listener is needed; these hosts have no `ping`)."""
        probe = self.run(source, [sys.executable, "-c", _REACH, target.address, str(timeout)], timeout=timeout + 30)
        return probe.returncode == 0

    def close(self) -> None:
        """Stop every process started here, the relay last (members may still say goodbye through
        it), and remove every namespace (their links go with them)."""
        _stop_all(self.processes)
        if self._relay is not None:
            _stop_all([self._relay])
        for namespace in [h.namespace for h in self.hosts.values()] + [self._switch]:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self.hosts.clear()


def unavailable() -> str | None:
    """Why this machine cannot make test hosts, or None when it can."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "`ip` and `tc` (iproute2) are needed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"ll{secrets.token_hex(2)}-probe"
    steps = [
        ["ip", "netns", "add", probe],
        ["ip", "-n", probe, "link", "add", "br0", "type", "bridge"],
        ["ip", "-n", probe, "link", "add", "va", "type", "veth", "peer", "name", "vb"],
        ["tc", "-n", probe, "qdisc", "replace", "dev", "va", "root", "tbf", *TBF_PROBE],
    ]
    try:
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                return f"`{' '.join(step[:6])} ...` failed: {done.stderr.strip()}"
        return None
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")


def _stop_all(processes: Sequence[subprocess.Popen[bytes]], grace: float = 10.0) -> None:
    """SIGTERM every process still running, then wait for all together; SIGKILL past `grace`."""
    running = [p for p in processes if p.poll() is None]
    for process in running:
        process.terminate()
    deadline = time.monotonic() + grace
    for process in running:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _line_within(stream: IO[bytes], seconds: float) -> bytes:
    """The next line of `stream`, or b"" when none came within `seconds` (or it closed)."""
    ready, _, _ = select.select([stream], [], [], seconds)
    return stream.readline() if ready else b""


def main(argv: Sequence[str] | None = None) -> int:
    """`demo`, or `hosts`: make hosts and keep them until Ctrl-C, for a user's own experiments."""
    parser = argparse.ArgumentParser(
        prog="python -m layerline.bench.netlab",
        description="Test hosts: network namespaces joined by a bridge, with a rate and a delay (needs root).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="two hosts and a 5 ms relay: time round trips across it, then remove all")
    hosts = commands.add_parser(
        "hosts",
        help="make hosts, print how to run commands in them, remove them on Ctrl-C",
        description="Make the named hosts on one bridge, print each one's address and how to run a command "
        "inside it (ip netns exec), and keep them until Ctrl-C or SIGTERM, then remove everything.",
    )
    hosts.add_argument("names", help="comma-separated host names, e.g. coord,s0,s1")
    hosts.add_argument("--rate", type=float, metavar="MBIT", help="shape every host's link to MBIT Mbit/s each way")
    hosts.add_argument(
        "--relay",
        action="append",
        default=[],
        metavar="HOST:PORT:MS",
        help="dial HOST:PORT through a relay that delays each direction by MS (repeatable); prints the address",
    )
    args = parser.parse_args(argv)
    reason = unavailable()
    if reason is not None:
        print(f"cannot make test hosts here: {reason}", file=sys.stderr)
        return 1
    if args.command == "demo":
        return _demo()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # as Ctrl-C, from here on
    with NetLab() as lab:
        for name in args.names.split(","):
            host = lab.host(name.strip(), rate_mbit=args.rate)
            print(f"{host.name}: {host.address}    run inside: ip netns exec {host.namespace} COMMAND")
        routes = []
        for spec in args.relay:
            name, _, rest = spec.partition(":")
            port, _, delay = rest.partition(":")
            if name not in lab.hosts or not port.isdigit() or not delay.replace(".", "", 1).isdigit():
                parser.error(f"--relay {spec!r}: not HOST:PORT:MS with HOST one of {', '.join(lab.hosts)}")
            routes.append((lab.hosts[name], int(port), float(delay)))
        for (host, port, delay), via in zip(routes, lab.relay(routes) if routes else []):
            print(f"{host.name}:{port} with {delay:g} ms each way: dial {via}")
        print("Ctrl-C removes every host", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    print("removed every namespace")
    return 0


def _demo() -> int:
    with NetLab() as lab:
        a, b = lab.host("a", rate_mbit=100), lab.host("b", rate_mbit=100)
        print(f"hosts {a.address} and {b.address} on one bridge, 100 Mbit/s each; a reaches b: {lab.reachable(a, b)}")
        echo = lab.popen(b, [sys.executable, "-c", _ECHO, b.address, "7000"])
        time.sleep(0.5)
        direct = lab.run(a, [sys.executable, "-c", _PING, b.address, "7000"], timeout=60)
        print(f"straight to {b.name}: {direct.stdout.strip()}")
        (via,) = lab.relay([(b, 7000, 5.0)])
        timed = lab.run(a, [sys.executable, "-c", _PING, *via.split(":")], timeout=60)
        print(f"through the relay to {b.name} (5 ms each way): {timed.stdout.strip()}")
        echo.terminate()
    print("removed every namespace")
    return 0


# A TCP echo server, a client that times 50 round trips of 64 bytes (medians in ms), and a probe
# that exits 0 when a connection to port 9 gets an answer (accepted or refused) in time.
_ECHO = """
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
while True:
    c, _ = s.accept()
    while d := c.recv(65536):
        c.sendall(d)
"""
_PING = """
import socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(50):
    t = time.perf_counter(); c.sendall(b"x" * 64); n = 0
    while n < 64:
        n += len(c.recv(64))
    times.append(1000 * (time.perf_counter() - t))
print(f"median round trip {statistics.median(times):.2f} ms")
"""
# A sink that answers one byte once it has read the size it was told, and a client that sends
# that many bytes and prints the rate it saw (Mbit/s, from its first byte to the answer).
_SINK = """
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
while True:
    c, _ = s.accept()
    want, n = int(c.recv(16).decode()), 0
    while n < want:
        n += len(c.recv(1 << 20))
    c.sendall(b"k")
"""
_BLAST = """
import socket, sys, time
size = int(sys.argv[3])
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
c.sendall(str(size).rjust(16).encode())
t = time.perf_counter()
c.sendall(bytes(size))
c.recv(1)
print(f"rate {size * 8 / (time.perf_counter() - t) / 1e6:.1f} Mbit/s")
"""
_REACH = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], 9), timeout=float(sys.argv[2])).close()
except ConnectionRefusedError:
    pass
except OSError:
    sys.exit(1)
"""

if __name__ == "__main__":
    sys.exit(main())
