"""gRPC settings every layerline process shares: channel and server options, size parsing.

Owns the one list of channel options (message-size limits, keepalive) so that no module builds
its own, how a server takes its port (`server_options`, `listen`), and the step between the
error vocabulary's `Code` and gRPC's `StatusCode`. Imports grpc only; safe for the client SDK.
"""

from __future__ import annotations

from typing import Protocol

import grpc

from .errors import Code
from .settings import DEFAULT_MAX_MESSAGE_BYTES

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "channel_options", "code_of", "grpc_status", "listen", "server_options"]

RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata of a refusal that may pass later: wait this long (ms)
PUSHBACK_KEY = "grpc-retry-pushback-ms"  # gRPC's standard name for the same hint (its retry policy reads it)
KEEPALIVE_MS = 10_000  # ping an idle long-lived stream this often
KEEPALIVE_TIMEOUT_MS = 5_000  # and call it dead when a ping is not answered in this time


class AddsPorts(Protocol):  # grpc.Server and grpc.aio.Server
    def add_insecure_port(self, address: str) -> int: ...


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Options for a channel or a server: message-size limits and keepalive on idle streams."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """A server's options: a channel's, and its port its own. gRPC sets SO_REUSEPORT by default,
    so a second server on a port in use would start and take some of its connections."""
    return [*channel_options(max_message_bytes), ("grpc.so_reuseport", 0)]


def listen(server: AddsPorts, address: str) -> int:
    """Bind `server` (made with `server_options`) to `address`: the port, or OSError naming it."""
    try:
        port = server.add_insecure_port(address)
    except RuntimeError:  # grpc's message only says to turn on its debug log
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {address}: the port is in use, or the host is not an address of this machine")
    return port


_GRPC_CODE = {c.value[0]: c for c in grpc.StatusCode}


def grpc_status(code: int) -> grpc.StatusCode:
    """gRPC's StatusCode of a `Code` (or of its wire value); UNKNOWN for a value gRPC lacks."""
    return _GRPC_CODE.get(int(code), grpc.StatusCode.UNKNOWN)


def code_of(status: grpc.StatusCode) -> Code:
    """The `Code` of gRPC's StatusCode."""
    return Code.of(status.value[0])


def aio_channel(
    target: str,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    own_subchannels: bool = False,
) -> grpc.aio.Channel:
    """An asyncio channel to `target`: TLS with `credentials` (a cluster member's mutual
    credentials, or a client's CA), else plaintext; the shared options either way.

    `own_subchannels`: its connections are its own, not shared through gRPC's process-wide pool
    with other channels of the same target and options, so a new channel connects afresh even
    while an older one to the same address still waits out its reconnect backoff."""
    options = channel_options(max_message_bytes)
    if own_subchannels:
        options.append(("grpc.use_local_subchannel_pool", 1))
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, credentials, options=options)


def listen_on(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
    """Bind `server` (made with `server_options`) to `address`, with TLS when `credentials` are
    given: the port, or OSError naming it."""
    if credentials is None:
        return listen(server, address)
    try:
        port = server.add_secure_port(address, credentials)
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {address}: the port is in use, or the host is not an address of this machine")
    return port
