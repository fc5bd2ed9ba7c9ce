"""Settings that several kinds of process share, and how settings cross a process boundary.

Owns `TelemetrySettings` (every server's `--trace`, `--otlp-endpoint`, `--metrics-port`), the
dtype names a stage accepts (`DTYPES`, as torch spells them), and `to_json` / `from_json`, which
carry a frozen settings dataclass (nested ones included) to another process: a tensor-parallel
stage hands its settings to its other ranks this way. Imports only the standard library, so the
command line reads every default from here without loading anything heavy.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import json
import logging
import re
import signal
import typing
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

TRACE_MODES = ("off", "console", "otlp")
DTYPES = ("float32", "bfloat16", "float16")  # weights and activations of a stage, as torch names them
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # gRPC message limit of every channel and server
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"  # every long-running process's log lines

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

S = TypeVar("S")


@dataclass(frozen=True)
class TelemetrySettings:
    trace: str = "off"  # off, console (JSON lines on stdout) or otlp (OTLP over gRPC)
    otlp_endpoint: str | None = None  # collector URL; None: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT
    metrics_port: int = 0  # Prometheus scrape port (GET /metrics); 0: no metrics
    metrics_host: str = "127.0.0.1"  # interface the scrape endpoint listens on

    def __post_init__(self) -> None:
        if self.trace not in TRACE_MODES:
            raise ValueError(f"--trace {self.trace!r} is not one of {', '.join(TRACE_MODES)}")
        if self.otlp_endpoint is not None:
            if self.trace != "otlp":
                raise ValueError(f"--otlp-endpoint is given but --trace is {self.trace}; add --trace otlp")
            collector_url(self.otlp_endpoint)
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port {self.metrics_port} must be in [0, 65535] (0: no metrics)")


def collector_url(endpoint: str) -> str:
    """An OTLP/gRPC endpoint as a URL: `HOST:PORT` means plaintext `http://HOST:PORT`."""
    url = endpoint if "://" in endpoint else f"http://{endpoint}"
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ValueError(
            f"--otlp-endpoint {endpoint!r} is not HOST:PORT or http(s)://HOST:PORT (http: plaintext, https: TLS)"
        )
    return url


@dataclass(frozen=True)
class TLSSettings:
    """A cluster member's TLS files (`--tls-ca`, `--tls-cert`, `--tls-key`): all three or none."""

    ca: str | None = None  # the cluster's CA: a peer must present a certificate it signed
    cert: str | None = None  # this process's certificate; its common name is its role
    key: str | None = None  # the certificate's private key

    def __post_init__(self) -> None:
        given = {"--tls-ca": self.ca, "--tls-cert": self.cert, "--tls-key": self.key}
        missing = [flag for flag, path in given.items() if not path]
        if len(missing) not in (0, 3):
            raise ValueError(f"--tls-ca, --tls-cert and --tls-key go together: {', '.join(missing)} missing")

    @property
    def enabled(self) -> bool:
        return self.ca is not None


def parse_size(text: str) -> int:
    """'512MiB', '2G', '65536' -> bytes (binary units; a trailing 'b' or 'ib' is optional)."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"size {text!r} is not a number with an optional unit (K, M, G, T), e.g. 512M")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").lower()[:1]])


def format_size(nbytes: int) -> str:
    """Bytes in the largest binary unit that divides them: 268435456 -> '256M' (`parse_size` reads it)."""
    for unit in ("T", "G", "M", "K"):
        if nbytes and nbytes % _UNITS[unit.lower()] == 0:
            return f"{nbytes // _UNITS[unit.lower()]}{unit}"
    return str(nbytes)


def configure_logging() -> None:
    """Log lines for long-running processes (stage workers and their ranks, the coordinator), and
    every thread's stack in the same log on SIGUSR1 (`kill -USR1 PID`; `layerline up` sends it to a
    process that does not exit within its grace, before SIGKILL)."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (OSError, ValueError, AttributeError):  # stderr without a file descriptor (captured, in-process)
        pass


def to_json(settings: object) -> str:
    """A frozen settings dataclass as JSON (nested dataclasses as objects, tuples as lists)."""
    assert dataclasses.is_dataclass(settings) and not isinstance(settings, type)
    return json.dumps(dataclasses.asdict(settings))


def from_json(cls: type[S], text: str) -> S:
    """The settings `to_json` wrote; a field missing from `text` keeps its default."""
    return _build(cls, json.loads(text))


def _build(cls: type[S], raw: dict[str, Any]) -> S:
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.name not in raw:
            continue
        value, hint = raw[field.name], hints[field.name]
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            value = _build(hint, value)  # type: ignore[arg-type]
        elif isinstance(value, list):
            value = tuple(value)
        values[field.name] = value
    return cls(**values)
