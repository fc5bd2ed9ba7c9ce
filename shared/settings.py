"""Settings that several kinds of process share, and how settings cross a process boundary.

Owns `TelemetrySettings` (every server's `--trace`, `--otlp-endpoint`, `--metrics-port`), the
dtype names a stage accepts (`DTYPES`, as torch spells them), and `to_json` / `from_json`, which
carry a frozen settings dataclass (nested ones included) to another process: a tensor-parallel
stage hands its settings to its other ranks this way. Imports only the standard library, so the
command line reads every default from here without loading anything heavy.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

TRACE_MODES = ("off", "console", "otlp")
DTYPES = ("float32", "bfloat16", "float16")  # weights and activations of a stage, as torch names them

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
