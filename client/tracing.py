"""Trace context for outgoing calls, through OpenTelemetry's propagators only.

Owns `call_metadata()`: the caller's current OpenTelemetry context as gRPC metadata, so that a
request's trace on the coordinator continues the caller's. OpenTelemetry is optional: when it is
not installed the SDK sends no trace metadata at all. Never builds a `traceparent` by hand.
"""

from __future__ import annotations

from types import ModuleType

propagate: ModuleType | None  # tests set this to None to act as if it were absent
try:
    from opentelemetry import propagate
except ImportError:  # the SDK needs only grpcio and protobuf
    propagate = None


def call_metadata() -> tuple[tuple[str, str], ...]:
    """The current context injected by the global propagator; empty without OpenTelemetry."""
    if propagate is None:
        return ()
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    # gRPC metadata keys must be lower case; the W3C propagators already write them so.
    return tuple((key.lower(), value) for key, value in carrier.items())
