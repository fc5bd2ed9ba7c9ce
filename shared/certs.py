"""A cluster's certificates: one CA, and a certificate and key for each role, in one directory.

Owns the directory's layout (`CertFiles`: `ca.crt`, `ca.key`, `<role>.crt`, `<role>.key`) and
`write_cluster_certs`, which makes them with the `cryptography` package: ECDSA P-256 keys, a CA
(basicConstraints CA:TRUE, may sign only leaves), and per role a leaf signed by it whose subject
common name (and organizational unit) is the role, with serverAuth and clientAuth extended key
usage (a stage both serves and calls) and the hosts it may serve as subject alternative names,
127.0.0.1 and localhost always among them. Keys are written mode 0600, certificates 0644.

Knows nothing of gRPC beyond the role names and `TLSFiles` (`shared/tls.py`), which reads the
files. `cryptography` is imported only when certificates are made, so importing this is cheap.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .tls import ROLES, TLSFiles

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

__all__ = ["ALWAYS_HOSTS", "CA_DAYS", "LEAF_DAYS", "CertFiles", "subject_names", "write_cluster_certs"]

LEAF_DAYS = 365  # default validity of a role's certificate
CA_DAYS = 3650  # default validity of the CA's
ALWAYS_HOSTS = ("127.0.0.1", "localhost")  # in every leaf's names, so a local cluster needs no --hosts
CA_NAME = "layerline cluster CA"  # the CA's subject common name
ORGANIZATION = "layerline"  # every subject's O
CLOCK_SKEW = datetime.timedelta(minutes=5)  # certificates are valid from this long before they are made

_DNS_LABEL = r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)"
_DNS_NAME = re.compile(rf"^(\*\.)?{_DNS_LABEL}(\.{_DNS_LABEL})*$")


@dataclass(frozen=True)
class CertFiles:
    """Where the cluster's certificate files are in `directory`."""

    directory: Path

    @property
    def ca(self) -> Path:
        """The CA's certificate: every member and client trusts it."""
        return self.directory / "ca.crt"

    @property
    def ca_key(self) -> Path:
        """The CA's private key: needed only to issue more certificates."""
        return self.directory / "ca.key"

    def cert(self, role: str) -> Path:
        return self.directory / f"{_checked_role(role)}.crt"

    def key(self, role: str) -> Path:
        return self.directory / f"{_checked_role(role)}.key"

    def paths(self) -> tuple[Path, ...]:
        """All eight files: the CA's certificate and key, then each role's."""
        return (self.ca, self.ca_key, *(path for role in ROLES for path in (self.cert(role), self.key(role))))

    def tls_files(self, role: str) -> TLSFiles:
        """The files a process of `role` is given (checked: ValueError if one is missing)."""
        return TLSFiles(ca=self.ca, cert=self.cert(role), key=self.key(role))

    def flags(self, role: str) -> list[str]:
        """The `--tls-ca/--tls-cert/--tls-key` arguments of a `layerline` process of `role`."""
        return ["--tls-ca", str(self.ca), "--tls-cert", str(self.cert(role)), "--tls-key", str(self.key(role))]


def _checked_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: expected one of {', '.join(ROLES)}")
    return role


def subject_names(hosts: Sequence[str]) -> list[str]:
    """`hosts` and ALWAYS_HOSTS, stripped and without repeats; ValueError for a name that is
    neither an IP address nor a DNS name."""
    names: list[str] = []
    for raw in (*hosts, *ALWAYS_HOSTS):
        name = raw.strip().removeprefix("[").removesuffix("]")  # [::1] as in a gRPC target
        if not name:
            raise ValueError(f"an empty host name in {','.join(hosts)!r}")
        if not _is_ip(name) and not _DNS_NAME.match(name):
            raise ValueError(f"host {raw!r} is neither an IP address nor a DNS name")
        if name not in names:
            names.append(name)
    return names


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def write_cluster_certs(
    directory: Path,
    hosts: Sequence[str],
    *,
    force: bool = False,
    leaf_days: int = LEAF_DAYS,
    ca_days: int = CA_DAYS,
) -> CertFiles:
    """Make a new CA and a leaf per role valid for `hosts` (and ALWAYS_HOSTS), and write them to
    `directory` (made mode 0700 if absent). FileExistsError, before anything is written, when a
    file is already there and not `force`; ValueError for a bad host name or validity."""
    if leaf_days < 1 or ca_days < leaf_days:
        raise ValueError(f"validity: need 1 <= leaf days ({leaf_days}) <= CA days ({ca_days})")
    names = subject_names(hosts)
    files = CertFiles(directory)
    existing = [str(path) for path in files.paths() if path.exists()]
    if existing and not force:
        more = f" and {len(existing) - 1} more of its files" if len(existing) > 1 else ""
        raise FileExistsError(f"refusing to overwrite {existing[0]}{more} (--force replaces them)")

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, ca_cert = _make_ca(now=now, days=ca_days)
    pem: dict[Path, bytes] = {files.ca: _cert_pem(ca_cert), files.ca_key: _key_pem(ca_key)}
    for role in ROLES:
        key, cert = _make_leaf(role, names, ca_key=ca_key, ca_cert=ca_cert, now=now, days=leaf_days)
        pem[files.cert(role)] = _cert_pem(cert)
        pem[files.key(role)] = _key_pem(key)

    if not directory.exists():
        directory.mkdir(parents=True)
        directory.chmod(0o700)  # after mkdir: its mode is filtered by the umask
    for path, data in pem.items():
        _write(path, data, mode=0o600 if path.suffix == ".key" else 0o644)
    return files


def _write(path: Path, data: bytes, *, mode: int) -> None:
    """Write `path` whole or not at all, with `mode` from the start (a key is never readable by others)."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def _name(common_name: str, *, unit: str | None = None) -> x509.Name:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, ORGANIZATION)]
    if unit is not None:
        attributes.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit))
    attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attributes)


def _make_ca(*, now: datetime.datetime, days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(CA_NAME)
    usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=True,
        crl_sign=True,
        encipher_only=False,
        decipher_only=False,
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _make_leaf(
    role: str,
    names: Sequence[str],
    *,
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    now: datetime.datetime,
    days: int,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    key = ec.generate_private_key(ec.SECP256R1())
    alternative_names = [
        x509.IPAddress(ipaddress.ip_address(name)) if _is_ip(name) else x509.DNSName(name) for name in names
    ]
    usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=False,
        crl_sign=False,
        encipher_only=False,
        decipher_only=False,
    )
    ca_key_id = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(role, unit=role))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.SubjectAlternativeName(alternative_names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_key_id), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _cert_pem(cert: x509.Certificate) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding

    return cert.public_bytes(Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    return key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
