"""Typed errors of the client SDK, mapped from gRPC status codes in one table.

Owns `LayerlineError` and its subclasses, and `error_from_rpc`, the one place that turns a
failed gRPC call (sync or asyncio, at the start of a call or in the middle of a stream) into
one of them. Knows nothing of the coordinator's messages.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import grpc

# Trailing metadata that says how long to wait before retrying, in milliseconds. The coordinator
# sends both; `retry-after-ms` is read first (a negative value means "now"), gRPC's standard
# pushback (gRFC A6; a negative value means "do not retry": no hint) when it is absent or not a
# finite number.
from layerline.shared.rpc import PUSHBACK_KEY as RETRY_PUSHBACK_KEY
from layerline.shared.rpc import RETRY_AFTER_KEY

Metadata = tuple[tuple[str, str | bytes], ...]


class LayerlineError(Exception):
    """A call failed with a gRPC status; `code` and `details` are the server's (of its last attempt).

    `attempts`: how many times the client made the call, its retries included (see `retries=`).
    """

    def __init__(self, code: grpc.StatusCode, details: str, *, metadata: Metadata = ()) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.metadata = metadata  # the call's trailing metadata
        self.attempts = 1  # set by the client once it gives up


class InvalidArgument(LayerlineError):
    """The request was rejected; `details` names the field and the limit."""


class ResourceExhausted(LayerlineError):
    """The server is full (or a limit was hit); retry after `retry_after` seconds if given (the
    client already did, `retries=` times, when no token had arrived).

    `retry_after` comes from the `retry-after-ms` trailer, or else from gRPC's standard
    `grpc-retry-pushback-ms`; a value that is not a finite number is no hint, and the other is read.
    """

    def __init__(self, code: grpc.StatusCode, details: str, *, metadata: Metadata = ()) -> None:
        super().__init__(code, details, metadata=metadata)
        self.retry_after = _retry_after(metadata)  # seconds, or None when the server said nothing


class Unavailable(LayerlineError):
    """The server or the workers behind it cannot serve now (after the coordinator's bounded
    failover, and the client's `retries=` when no token had arrived)."""


class DeadlineExceeded(LayerlineError):
    """The call's deadline passed before it finished."""


class NotFound(LayerlineError):
    """The model (or health service) asked for is not known to the server."""


class Unauthenticated(LayerlineError):
    """The coordinator wants a bearer token (`Client(..., token=...)`), and this one is missing or wrong."""


class PermissionDenied(LayerlineError):
    """The token is valid, but not for this call (ClusterStatus needs an admin token)."""


class Internal(LayerlineError):
    """The server failed, or broke the protocol."""


ERROR_OF: dict[grpc.StatusCode, type[LayerlineError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.INTERNAL: Internal,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


@runtime_checkable
class _FailedCall(Protocol):
    """What both grpc.RpcError (sync) and grpc.aio.AioRpcError expose."""

    def code(self) -> grpc.StatusCode: ...

    def details(self) -> str | None: ...

    def trailing_metadata(self) -> Iterable[tuple[str, str | bytes]] | None: ...


def error_from_rpc(err: grpc.RpcError) -> LayerlineError:
    """The typed error for a failed call; codes without a subclass give a plain LayerlineError."""
    if not isinstance(err, _FailedCall):
        return LayerlineError(grpc.StatusCode.UNKNOWN, repr(err))
    code = err.code()
    metadata = tuple((key, value) for key, value in err.trailing_metadata() or ())
    return ERROR_OF.get(code, LayerlineError)(code, err.details() or "", metadata=metadata)


def _retry_after(metadata: Metadata) -> float | None:
    """Seconds to wait from the first usable hint, `retry-after-ms` before `grpc-retry-pushback-ms`."""
    after, pushback = _milliseconds(metadata, RETRY_AFTER_KEY), _milliseconds(metadata, RETRY_PUSHBACK_KEY)
    if after is not None:
        return max(0.0, after) / 1000.0
    if pushback is not None and pushback >= 0.0:
        return pushback / 1000.0
    return None


def _milliseconds(metadata: Metadata, key: str) -> float | None:
    """The first value under `key`, as a number; None when absent or not a finite number."""
    for name, value in metadata:
        if name.lower() != key:
            continue
        text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
        try:
            number = float(text)
        except ValueError:
            return None  # a malformed hint is no hint
        return number if math.isfinite(number) else None
    return None
