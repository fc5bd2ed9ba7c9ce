"""Cluster certificates and TLS: what `layerline certs` writes, who gets through the handshake of
a member's port (a real grpc.aio server on 127.0.0.1 serving the standard health service), which
role its servicer sees, and what TLS costs per call against plaintext."""

from __future__ import annotations

import asyncio
import ipaddress
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from cryptography.x509.verification import DNSName, IPAddress, PolicyBuilder, Store, VerificationError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from layerline.cli import main
from layerline.shared.certs import CertFiles, write_cluster_certs
from layerline.shared.rpc import channel_options, server_options
from layerline.shared.tls import ROLES, TLSFiles, ca_channel_credentials, peer_role, server_credentials

LOCAL = "127.0.0.1"
CALLS = 200  # sequential unary calls timed over one open channel
CONNECTIONS = 20  # fresh channels timed from dial to the first answer
REFUSED = "refused"  # the call never reached the servicer


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    return write_cluster_certs(tmp_path_factory.mktemp("cluster") / "certs", ["node1.example"])


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    """Another cluster's files: a CA of its own, the same host names and roles."""
    return write_cluster_certs(tmp_path_factory.mktemp("other") / "certs", ["node1.example"])


def _certificate(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- layerline certs -----------------------------------------------------------------------


def test_certs_writes_a_ca_and_a_certificate_per_role(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "certs"
    assert main(["certs", str(directory), "--hosts", "node1.example,10.0.0.5"]) == 0
    files = CertFiles(directory)
    assert {p.name for p in directory.iterdir()} == {p.name for p in files.paths()}
    assert len(files.paths()) == 8
    assert _mode(directory) == 0o700
    for path in files.paths():
        assert _mode(path) == (0o600 if path.suffix == ".key" else 0o644), path
    printed = capsys.readouterr().out
    assert all(str(path) in printed for path in files.paths()), printed

    ca = _certificate(files.ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert load_pem_private_key(files.ca_key.read_bytes(), None).public_key() == ca.public_key()
    policy = PolicyBuilder().store(Store([ca]))
    for role in ROLES:
        leaf = _certificate(files.cert(role))
        assert leaf.issuer == ca.subject
        assert [a.value for a in leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)] == [role]
        usage = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert set(usage) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert names.get_values_for_type(x509.DNSName) == ["node1.example", "localhost"]
        assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.5", LOCAL]
        assert load_pem_private_key(files.key(role).read_bytes(), None).public_key() == leaf.public_key()
        policy.build_client_verifier().verify(leaf, [])
        for name in (DNSName("node1.example"), DNSName("localhost"), *_ips("10.0.0.5", LOCAL)):
            policy.build_server_verifier(name).verify(leaf, [])
        with pytest.raises(VerificationError):  # a name it was not issued for
            policy.build_server_verifier(DNSName("node2.example")).verify(leaf, [])


def _ips(*addresses: str) -> list[IPAddress]:
    return [IPAddress(ipaddress.ip_address(a)) for a in addresses]


def test_a_certificate_of_another_ca_does_not_verify(cluster: CertFiles, other: CertFiles) -> None:
    policy = PolicyBuilder().store(Store([_certificate(cluster.ca)]))
    with pytest.raises(VerificationError):
        policy.build_client_verifier().verify(_certificate(other.cert("client")), [])


def test_certs_refuses_to_overwrite_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "certs"
    assert main(["certs", str(directory)]) == 0
    ca = (directory / "ca.crt").read_bytes()
    capsys.readouterr()
    assert main(["certs", str(directory), "--hosts", "node1.example"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: refusing to overwrite ") and str(directory / "ca.crt") in error, error
    assert (directory / "ca.crt").read_bytes() == ca
    assert main(["certs", str(directory), "--force"]) == 0
    assert (directory / "ca.crt").read_bytes() != ca
    assert _mode(directory / "stage.key") == 0o600


def test_certs_refuses_a_bad_host_name_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "certs"
    assert main(["certs", str(directory), "--hosts", "node1.example,bad name"]) == 2
    assert "'bad name' is neither an IP address nor a DNS name" in capsys.readouterr().err
    assert not directory.exists()


@pytest.mark.parametrize("flag", ["--tls-ca", "--tls-cert", "--tls-key"])
def test_tls_files_name_the_flag_and_path_of_a_bad_file(cluster: CertFiles, tmp_path: Path, flag: str) -> None:
    paths = {"--tls-ca": cluster.ca, "--tls-cert": cluster.cert("stage"), "--tls-key": cluster.key("stage")}
    missing = tmp_path / "missing.pem"
    with pytest.raises(ValueError, match=f"^{flag} {missing}: no such file$"):
        TLSFiles(*{**paths, flag: missing}.values())
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a PEM file\n")
    with pytest.raises(ValueError, match=f"^{flag} {garbage}: not a PEM"):
        TLSFiles(*{**paths, flag: garbage}.values())


class _Context:
    def __init__(self, auth: Mapping[str, Iterable[bytes]]) -> None:
        self._auth = auth

    def auth_context(self) -> Mapping[str, Iterable[bytes]]:
        return self._auth


def test_peer_role_is_none_unless_a_tls_peer_names_a_role() -> None:
    ssl = {"transport_security_type": [b"ssl"]}
    assert peer_role(_Context({**ssl, "x509_common_name": [b"stage"]})) == "stage"
    assert peer_role(_Context({**ssl, "x509_common_name": [b"admin"]})) is None
    assert peer_role(_Context(ssl)) is None  # no client certificate
    assert peer_role(_Context({"transport_security_type": [b"insecure"], "x509_common_name": [b"stage"]})) is None
    assert peer_role(_Context({})) is None


# --- a real grpc.aio server ------------------------------------------------------------------


class RecordingHealth(health.aio.HealthServicer):  # type: ignore[misc,name-defined]
    """The standard health service, noting in each Check the role `peer_role` reads."""

    def __init__(self) -> None:
        super().__init__()
        self.roles: list[str | None] = []

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> object:
        self.roles.append(peer_role(context))
        return await super().Check(request, context)


async def _serve(credentials: grpc.ServerCredentials | None) -> tuple[grpc.aio.Server, str, RecordingHealth]:
    server = grpc.aio.server(options=server_options())
    servicer = RecordingHealth()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    address = f"{LOCAL}:0"
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    assert port
    await server.start()
    return server, f"{LOCAL}:{port}", servicer


def _channel(target: str, credentials: grpc.ChannelCredentials | None, *, name: str | None = None) -> grpc.aio.Channel:
    options = [*channel_options(), *([("grpc.ssl_target_name_override", name)] if name else [])]
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, credentials, options=options)


async def _check(channel: grpc.aio.Channel) -> str:
    """One health Check: "OK", or the code of the failure."""
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    return "OK"


def _call(
    server: grpc.ServerCredentials | None, client: grpc.ChannelCredentials | None, *, name: str | None = None
) -> tuple[str, str | None]:
    """Start a server, make one call; the call's outcome and the role its servicer saw (REFUSED
    when the call never reached it)."""

    async def run() -> tuple[str, str | None]:
        listening, target, servicer = await _serve(server)
        try:
            async with _channel(target, client, name=name) as channel:
                outcome = await _check(channel)
        finally:
            await listening.stop(None)
        assert len(servicer.roles) <= 1
        return outcome, servicer.roles[0] if servicer.roles else REFUSED

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("server_role", "caller_role"),
    [("coordinator", "client"), ("coordinator", "stage"), ("stage", "coordinator"), ("stage", "stage")],
)
def test_a_member_port_admits_a_cluster_certificate_and_sees_its_role(
    cluster: CertFiles, server_role: str, caller_role: str
) -> None:
    server = cluster.tls_files(server_role).server_credentials(require_client_auth=True)
    assert _call(server, cluster.tls_files(caller_role).channel_credentials()) == ("OK", caller_role)


CALLERS: dict[str, Callable[[CertFiles, CertFiles], grpc.ChannelCredentials | None]] = {
    "no certificate": lambda cluster, other: ca_channel_credentials(cluster.ca),
    "another CA's certificate": lambda cluster, other: TLSFiles(
        ca=cluster.ca, cert=other.cert("client"), key=other.key("client")
    ).channel_credentials(),
    "plaintext": lambda cluster, other: None,
}


@pytest.mark.parametrize("caller", CALLERS)
def test_a_member_port_refuses_a_caller_without_a_cluster_certificate(
    cluster: CertFiles, other: CertFiles, caller: str
) -> None:
    server = cluster.tls_files("coordinator").server_credentials(require_client_auth=True)
    assert _call(server, CALLERS[caller](cluster, other)) == ("UNAVAILABLE", REFUSED)


def test_a_member_refuses_a_server_of_another_ca_or_host(cluster: CertFiles, other: CertFiles) -> None:
    client = cluster.tls_files("stage").channel_credentials()
    stranger = other.tls_files("stage").server_credentials(require_client_auth=True)
    assert _call(stranger, client) == ("UNAVAILABLE", REFUSED)
    member = cluster.tls_files("stage").server_credentials(require_client_auth=True)
    assert _call(member, client, name="node1.example") == ("OK", "stage")
    assert _call(member, client, name="node2.example") == ("UNAVAILABLE", REFUSED)


def test_the_client_port_asks_no_certificate(cluster: CertFiles) -> None:
    port = server_credentials(cluster.cert("coordinator"), cluster.key("coordinator"))
    assert _call(port, ca_channel_credentials(cluster.ca)) == ("OK", None)
    assert _call(port, cluster.tls_files("client").channel_credentials()) == ("OK", None)  # not asked: no role
    assert _call(port, None) == ("UNAVAILABLE", REFUSED)


def test_tls_and_plaintext_call_costs(cluster: CertFiles, capsys: pytest.CaptureFixture[str]) -> None:
    """Reports (does not judge) a fresh connection's first call and a call on an open channel."""
    mutual = cluster.tls_files("coordinator").server_credentials(require_client_auth=True)
    client = cluster.tls_files("client").channel_credentials()

    async def measure(server: grpc.ServerCredentials | None, credentials: grpc.ChannelCredentials | None) -> str:
        listening, target, servicer = await _serve(server)
        try:
            start = time.perf_counter()
            for _ in range(CONNECTIONS):
                async with _channel(target, credentials) as channel:
                    assert await _check(channel) == "OK"
            connect = (time.perf_counter() - start) / CONNECTIONS
            async with _channel(target, credentials) as channel:
                assert await _check(channel) == "OK"
                start = time.perf_counter()
                for _ in range(CALLS):
                    assert await _check(channel) == "OK"
                call = (time.perf_counter() - start) / CALLS
        finally:
            await listening.stop(None)
        role = "client" if server else None
        assert servicer.roles == [role] * (CONNECTIONS + 1 + CALLS)
        return f"new connection + first call {connect * 1e3:6.2f} ms; open channel {call * 1e6:6.0f} us/call"

    plaintext = asyncio.run(measure(None, None))
    tls = asyncio.run(measure(mutual, client))
    with capsys.disabled():
        print(f"\nplaintext:  {plaintext}\nmutual TLS: {tls}  ({CALLS} sequential calls, {CONNECTIONS} connections)")
