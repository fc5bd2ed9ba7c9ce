"""A layerline cluster on test hosts: the coordinator and each stage in a `netlab` host of its own.

Owns `LabCluster`: which process runs on which host, their flags (mutual TLS with a CA made for
the lab's addresses), every member dialled through the lab's relay, and a client script run
inside the coordinator's host. The hosts themselves are `netlab`'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from layerline.shared.certs import CertFiles, write_cluster_certs

from .netlab import Host, NetLab


@dataclass
class LabCluster:
    """A coordinator and chains of stage workers, each process on a lab host of its own choosing.

    Every member is dialled through the lab's relay (`delay_ms` each way, each connection): a
    stage binds its host's address and advertises the relay's, and registers through it; with
    `tls`, the lab makes a CA whose certificates name every host and the relay.
    """

    lab: NetLab
    checkpoint: Path
    coordinator: Host
    chains: list[list[tuple[Host, str]]]  # each replica's stages: (host, "START:END")
    delay_ms: float = 0.0
    tls: bool = True
    log_dir: Path = field(default_factory=lambda: Path("/tmp") / f"layerline-netlab-{os.getpid()}")
    stage_args: tuple[str, ...] = ("--threads", "1", "--kv-memory", "32M")
    certs: CertFiles | None = None
    target: str = ""  # the coordinator's client port, as clients dial it
    advertised: dict[str, str] = field(default_factory=dict)  # stage host name -> the address it advertises

    def start(self) -> None:
        lab = self.lab
        if lab.relay_host is None:
            lab.relay_host = lab.host("relay")
        stages = [host for chain in self.chains for host, _ in chain]
        dialled = lab.relay(
            [(self.coordinator, 7070, self.delay_ms), (self.coordinator, 7071, self.delay_ms)]
            + [(host, 7100, self.delay_ms) for host in stages]
        )
        self.target, registry, *stage_addresses = dialled
        self.advertised = {host.name: address for host, address in zip(stages, stage_addresses)}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.tls:
            names = [h.address for h in lab.hosts.values()]
            self.certs = write_cluster_certs(self.log_dir / "tls", names, force=True)
        model = ["--model", str(self.checkpoint)]
        ports = ["--host", self.coordinator.address, "--port", "7070", "--cluster-port", "7071"]
        self._spawn(self.coordinator, "coordinator", ["coordinator", *model, *ports, *self._tls("coordinator")])
        for host, layers in (member for chain in self.chains for member in chain):
            argv = ["stage", *model, "--layers", layers, "--host", host.address, "--port", "7100"]
            argv += ["--advertise", self.advertised[host.name], "--coordinator", registry, *self.stage_args]
            self._spawn(host, f"stage-{host.name}", [*argv, *self._tls("stage")])

    def client(self, prompts: Sequence[str], *, max_tokens: int, script: Path) -> subprocess.Popen[str]:
        """`script` (tests/netlab_client.py) run on the coordinator's host against this cluster."""
        args = {"target": self.target, "prompts": list(prompts), "max_tokens": max_tokens, "chains": len(self.chains)}
        if self.certs is not None:
            args["ca_cert"] = str(self.certs.ca)
        argv = [sys.executable, str(script), json.dumps(args)]
        return self.lab.popen(self.coordinator, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # type: ignore[return-value]  # text

    def _tls(self, role: str) -> list[str]:
        return self.certs.flags(role) if self.certs is not None else []

    def _spawn(self, host: Host, name: str, argv: list[str]) -> None:
        log = (self.log_dir / f"{name}.log").open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.lab.popen(host, [sys.executable, "-m", "layerline", *argv], stdout=log, stderr=subprocess.STDOUT, env=env)

    def logs(self) -> str:
        """The tail of every process's log, for a failure's message."""
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in self.log_dir.glob("*.log"))
