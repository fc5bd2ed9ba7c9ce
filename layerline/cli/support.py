"""What every `layerline` command group shares: user-facing errors, help formatting, logging,
the telemetry flags.

A failure the user can act on is raised as `CommandError` (or translated to it with
`reported_as_errors`) and printed by `layerline.cli.main` as `error: ...` with exit code 2 and
no traceback.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeAlias

from layerline.shared.settings import TRACE_MODES, TelemetrySettings, configure_logging

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_USER_ERROR",
    "CommandError",
    "HelpFormatter",
    "Subcommands",
    "add_telemetry_flags",
    "configure_logging",
    "reported_as_errors",
    "telemetry_settings",
]

Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


class CommandError(Exception):
    """A failure the user can act on: printed as `error: <message>`, exit code 2."""


@contextmanager
def reported_as_errors(*error_types: type[Exception]) -> Iterator[None]:
    """Turn the domain exceptions `error_types` raised in the block into `CommandError`."""
    try:
        yield
    except error_types as exc:
        raise CommandError(str(exc)) from exc


class HelpFormatter(argparse.HelpFormatter):
    """Wraps paragraphs like argparse's default but keeps indented lines (lists) as written."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        fill = super()._fill_text
        return "\n".join(
            indent + line if line.startswith("  ") or not line else fill(line, width, indent)
            for line in text.split("\n")
        )


def add_telemetry_flags(p: argparse.ArgumentParser, *, metrics_port_help: str) -> None:
    """`--trace`, `--otlp-endpoint` and `--metrics-port`, the same for every server command."""
    p.add_argument(
        "--trace",
        default="off",
        choices=TRACE_MODES,
        help="export OpenTelemetry traces: off; console (one JSON line per span on stdout); "
        "otlp (OTLP over gRPC to --otlp-endpoint, else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT "
        "or OTEL_EXPORTER_OTLP_ENDPOINT, else http://localhost:4317) (default: off)",
    )
    p.add_argument(
        "--otlp-endpoint",
        metavar="URL",
        help="OTLP/gRPC collector for --trace otlp: HOST:PORT or http://HOST:PORT (plaintext), https://HOST:PORT (TLS)",
    )
    p.add_argument("--metrics-port", type=int, default=0, metavar="P", help=metrics_port_help)


def telemetry_settings(args: argparse.Namespace, *, host: str) -> TelemetrySettings:
    """The settings of parsed telemetry flags; a bad value or combination is a CommandError."""
    with reported_as_errors(ValueError):
        return TelemetrySettings(
            trace=args.trace, otlp_endpoint=args.otlp_endpoint, metrics_port=args.metrics_port, metrics_host=host
        )
