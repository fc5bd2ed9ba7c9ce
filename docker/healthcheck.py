"""The HEALTHCHECK of the layerline images: is the server at HOST:PORT SERVING?

Asks the standard grpc.health.v1 service, which the stage worker and the coordinator both serve,
for the overall status (the empty service name). When $LAYERLINE_TLS_CA is set (the servers'
--tls-ca default), it connects with TLS, trusting that CA and presenting $LAYERLINE_TLS_CERT and
$LAYERLINE_TLS_KEY: a stage's port wants a member's certificate. Exits 0 on SERVING; 1 on any other status, or
when there is no answer within the deadline (Docker reads 1 as unhealthy and reserves 2). A
stage is SERVING once its weights are loaded and a one-token forward has run, NOT_SERVING while
it drains or after a tensor-parallel rank failed; the coordinator is SERVING once it listens.

    python healthcheck.py HOST:PORT
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

DEADLINE_SECONDS = 3.0  # kept under the images' HEALTHCHECK --timeout


def main(argv: Sequence[str] | None = None) -> int:
    """Check the server named by the one argument; returns the exit code Docker reads."""
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) != 1:
        print("usage: healthcheck.py HOST:PORT", file=sys.stderr)
        return 1
    address = args[0]
    request = health_pb2.HealthCheckRequest(service="")
    with _channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=DEADLINE_SECONDS)
        except grpc.RpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.Call) else str(exc)
            print(f"{address}: no answer ({reason})", file=sys.stderr)
            return 1
    print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _channel(address: str) -> grpc.Channel:
    ca = os.environ.get("LAYERLINE_TLS_CA")
    if not ca:
        return grpc.insecure_channel(address)
    cert, key = os.environ.get("LAYERLINE_TLS_CERT"), os.environ.get("LAYERLINE_TLS_KEY")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes(),
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None,
    )
    return grpc.secure_channel(address, credentials)


if __name__ == "__main__":
    sys.exit(main())
