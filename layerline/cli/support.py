"""What every `layerline` command group shares: user-facing errors, help formatting, logging,
the telemetry flags.

A failure the user can act on is raised as `CommandError` (or translated to it with
`reported_as_errors`) and printed by `layerline.cli.main` as `error: ...` with exit code 2 and
no traceback.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeAlias

from layerline.shared.sampling import MAX_SPECULATE
from layerline.shared.settings import TRACE_MODES, TelemetrySettings, TLSSettings, configure_logging

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_USER_ERROR",
    "CommandError",
    "HelpFormatter",
    "Subcommands",
    "add_client_flags",
    "add_telemetry_flags",
    "add_tls_flags",
    "client_credentials",
    "configure_logging",
    "http_port_flag",
    "prefix_flags",
    "reported_as_errors",
    "speculate_flag",
    "telemetry_settings",
    "tls_settings",
]

# The TLS flags' defaults, which the images' health check reads too.
TLS_VARIABLES = {"--tls-ca": "LAYERLINE_TLS_CA", "--tls-cert": "LAYERLINE_TLS_CERT", "--tls-key": "LAYERLINE_TLS_KEY"}
TOKEN_VARIABLE = "LAYERLINE_TOKEN"  # the client commands' default --token
CA_VARIABLE = "LAYERLINE_CA_CERT"  # and --ca-cert

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


def add_tls_flags(p: argparse.ArgumentParser, *, who: str) -> None:
    """`--tls-ca`, `--tls-cert`, `--tls-key`: a cluster member's certificate (`layerline certs`)."""
    group = p.add_argument_group(
        "mutual TLS",
        f"With all three, {who} and every member it talks to must present a certificate signed by "
        "the cluster's CA, whose common name is the member's role (coordinator, stage); each call is "
        "allowed by role. Without them every member port is plaintext: a trusted network only. "
        "`layerline certs DIR --hosts ...` writes a CA and a certificate per role.",
    )
    for flag, what in (
        ("--tls-ca", "the cluster's CA certificate (PEM)"),
        ("--tls-cert", "this process's certificate (PEM), signed by the CA"),
        ("--tls-key", "its private key (PEM)"),
    ):
        variable = TLS_VARIABLES[flag]
        group.add_argument(
            flag, default=os.environ.get(variable), metavar="FILE", help=f"{what} (default: ${variable})"
        )


def tls_settings(args: argparse.Namespace) -> TLSSettings:
    """The settings of parsed TLS flags; a partial set is a CommandError."""
    with reported_as_errors(ValueError):
        return TLSSettings(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key)


def add_client_flags(p: argparse.ArgumentParser, *, default_target: str) -> None:
    """`--target`, `--token`, `--ca-cert`: how a client command reaches a coordinator."""
    p.add_argument(
        "--target", default=default_target, metavar="ADDR", help="coordinator address (default: %(default)s)"
    )
    p.add_argument(
        "--token", metavar="TOKEN", help=f"bearer token, when the coordinator requires one (default: ${TOKEN_VARIABLE})"
    )
    p.add_argument(
        "--ca-cert",
        metavar="FILE",
        help=f"the CA that signed the coordinator's certificate: connect with TLS (default: ${CA_VARIABLE}; "
        "none: plaintext)",
    )


def client_credentials(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(token, CA file) from the flags, else from $LAYERLINE_TOKEN and $LAYERLINE_CA_CERT."""
    return args.token or os.environ.get(TOKEN_VARIABLE) or None, args.ca_cert or os.environ.get(CA_VARIABLE) or None


def http_port_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        metavar="P",
        help="also serve the OpenAI-compatible HTTP API on port P of the same host: POST /v1/completions, "
        "POST /v1/chat/completions, GET /v1/models, GET /health (200 while a complete chain serves), and "
        "GET /metrics with --metrics-port; the same tokens and the same TLS certificate as the gRPC API "
        "(default: off; vLLM's port is 8000)",
    )


def _speculate(text: str) -> int:
    k = int(text)
    if not 0 <= k <= MAX_SPECULATE:
        raise argparse.ArgumentTypeError(f"{k} must be in [0, {MAX_SPECULATE}] (0: off)")
    return k


def speculate_flag(p: argparse.ArgumentParser, *, default: int = 0) -> None:
    p.add_argument(
        "--speculate",
        type=_speculate,
        default=default,
        metavar="K",
        help="speculative decoding by prompt lookup: each decode step drafts up to K tokens (what followed the "
        "latest earlier occurrence of the sequence's last 1 to 3 tokens, in its prompt or output) and the chain "
        "verifies them in one forward, so an answer that quotes or edits its prompt takes fewer steps; greedy and "
        "seeded output stay token for token the same. A request's `speculate` overrides it. "
        f"0 is off, at most {MAX_SPECULATE} (default: %(default)s)",
    )


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction from 0 up to (not including) 1")
    return value


def prefix_flags(p: argparse.ArgumentParser, *, cache_default: float) -> None:
    """The coordinator's prefix sharing: `layerline coordinator`'s flags, and `up`'s and `run`'s for theirs."""
    p.add_argument(
        "--no-prefix-sharing",
        action="store_true",
        help="compute every prompt in full; by default a new sequence whose first tokens "
        "(4 or more) match those of a live or cached sequence on its chain copies "
        "their KV instead",
    )
    p.add_argument(
        "--prefix-cache",
        type=_fraction,
        default=cache_default,
        metavar="F",
        help="share of each chain's KV memory (that of its smallest stage) in which requests "
        "that ended keep their KV, least recently used out first, for later prompts "
        "that start the same way: a system prompt, the turns of a chat; 0 frees every "
        f"request's KV when it ends (default: {cache_default:g})",
    )


def health_port_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--health-port",
        type=int,
        default=0,
        metavar="P",
        help="also serve the standard gRPC health service alone, in plaintext, on this port: for probes that "
        "speak no TLS, such as Kubernetes' gRPC probes (default: 0, none)",
    )
