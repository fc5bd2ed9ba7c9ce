"""TLS for layerline's gRPC ports: credentials from PEM files, and the role of a verified peer.

Owns the three roles a cluster certificate can name (`ROLES`: its subject common name), the
files a process is given (`TLSFiles`: the cluster CA, its own certificate and key, checked when
constructed), the credentials made from them, and `peer_role`, which reads the role of the
caller's verified certificate in a servicer. Two pairs of credentials:

- mutual TLS inside the cluster: `TLSFiles.server_credentials(require_client_auth=True)` on a
  member's port, `TLSFiles.channel_credentials()` for its calls; each side presents its
  certificate and trusts only the cluster CA;
- server-only TLS on the client-facing port: `server_credentials(cert, key)` (no client
  certificate asked for) and `ca_channel_credentials(ca)` for a client that only trusts a CA.

Knows nothing of how certificates are made (`shared/certs.py`), of which role may call what (the
servicers decide), or of ports and addresses. Imports grpc and the flags' settings
(`settings.TLSSettings`) only; safe for the client SDK.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc

from .settings import TLSSettings

__all__ = ["ROLES", "TLSFiles", "ca_channel_credentials", "member_files", "peer_role", "server_credentials"]

# What a cluster certificate's subject common name says its holder is.
ROLES = ("coordinator", "stage", "client")

_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"
_PRIVATE_KEY = b"PRIVATE KEY-----"  # BEGIN PRIVATE KEY, BEGIN EC PRIVATE KEY, BEGIN RSA PRIVATE KEY
_ENCRYPTED_KEY = b"-----BEGIN ENCRYPTED PRIVATE KEY-----"


class HasAuthContext(Protocol):  # grpc.aio.ServicerContext
    def auth_context(self) -> Mapping[str, Iterable[bytes]]: ...


def _read_certificate(path: Path, *, flag: str) -> bytes:
    pem = _read(path, flag=flag)
    if _CERTIFICATE not in pem:
        raise ValueError(f"{flag} {path}: not a PEM certificate (no '{_CERTIFICATE.decode()}' line)")
    return pem


def _read_key(path: Path, *, flag: str) -> bytes:
    pem = _read(path, flag=flag)
    if _ENCRYPTED_KEY in pem:
        raise ValueError(f"{flag} {path}: the key is encrypted; gRPC needs it unencrypted (and the file mode 0600)")
    if _PRIVATE_KEY not in pem:
        raise ValueError(f"{flag} {path}: not a PEM private key")
    return pem


def _read(path: Path, *, flag: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{flag} {path}: no such file") from None
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from exc


@dataclass(frozen=True)
class TLSFiles:
    """One cluster member's TLS files, read and checked when constructed: a missing, unreadable
    or non-PEM file is a ValueError naming its flag and path."""

    ca: Path  # the cluster CA's certificate: the only issuer trusted for peers (--tls-ca)
    cert: Path  # this process's certificate, signed by the CA, its common name its role (--tls-cert)
    key: Path  # the certificate's private key, unencrypted PEM (--tls-key)
    _pem: tuple[bytes, bytes, bytes] = field(init=False, repr=False, compare=False)  # ca, cert, key as read

    def __post_init__(self) -> None:
        pem = (
            _read_certificate(self.ca, flag="--tls-ca"),
            _read_certificate(self.cert, flag="--tls-cert"),
            _read_key(self.key, flag="--tls-key"),
        )
        object.__setattr__(self, "_pem", pem)

    def server_credentials(self, *, require_client_auth: bool) -> grpc.ServerCredentials:
        """A port that presents this certificate. With `require_client_auth` a caller must present
        a certificate signed by the CA or its handshake fails (then `peer_role` names its role);
        without, no client certificate is asked for and `peer_role` is None."""
        ca, cert, key = self._pem
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=require_client_auth)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Mutual TLS for a channel: presents this certificate and trusts only a server whose
        certificate the CA signed for the host dialled."""
        ca, cert, key = self._pem
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def member_files(settings: TLSSettings) -> TLSFiles | None:
    """The checked files of a member's `--tls-*` flags; None when TLS is off."""
    if settings.ca is None or settings.cert is None or settings.key is None:
        return None
    return TLSFiles(ca=Path(settings.ca), cert=Path(settings.cert), key=Path(settings.key))


def server_credentials(cert: Path, key: Path) -> grpc.ServerCredentials:
    """Server-only TLS for the client-facing port: presents `cert` (any issuer the clients trust)
    and asks no client certificate; clients prove themselves with bearer tokens instead."""
    pair = (_read_key(key, flag="--tls-key"), _read_certificate(cert, flag="--tls-cert"))
    return grpc.ssl_server_credentials([pair], require_client_auth=False)


def ca_channel_credentials(ca: Path) -> grpc.ChannelCredentials:
    """A channel that trusts only servers whose certificate `ca` signed, and presents none."""
    return grpc.ssl_channel_credentials(root_certificates=_read_certificate(ca, flag="--tls-ca"))


def peer_role(context: HasAuthContext) -> str | None:
    """The role of the caller's verified certificate: its common name when that is one of ROLES.

    None for a plaintext call, a call without a client certificate, or a common name that is no
    role. A name is trustworthy only on a port made with `require_client_auth=True`: only there
    has gRPC checked that the cluster CA signed the certificate before the call arrives.
    """
    auth = context.auth_context()
    if list(auth.get("transport_security_type", ())) != [b"ssl"]:
        return None
    names = list(auth.get("x509_common_name", ()))
    if len(names) != 1:
        return None
    name = names[0].decode("utf-8", errors="replace")
    return name if name in ROLES else None
