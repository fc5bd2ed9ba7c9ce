"""A cluster across an untrusted network: `up --tls` with tokens, probed with raw gRPC.

One module-wide cluster (`LocalCluster` with tls and api tokens: what `layerline up --tls
--api-tokens FILE` starts) serves the real SmolLM2. The tests connect to its ports the way an
outsider, a client, a stage and the coordinator would, and send what the security issue listed
as hostile; each gets the status it should, and afterwards the cluster answers a normal request
with the tokens it gave before.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from layerline.client import Client, InvalidArgument, PermissionDenied, Unauthenticated
from layerline.launcher import ClusterPlan, LocalCluster
from layerline.protos.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc, tensor_pb2
from layerline.shared.certs import CertFiles, write_cluster_certs

from .stage_client import free_port

pytestmark = [pytest.mark.real_model, pytest.mark.cluster]

USER, ADMIN = "user-token-1", "admin-token-1"
PROMPT = "The capital of France is"


class Secured:
    def __init__(self, cluster: LocalCluster, reference: list[int], stages: list[str], model_id: str) -> None:
        self.cluster = cluster
        self.model_id = model_id
        self.reference = reference  # greedy tokens of PROMPT, before any hostile request
        self.stages = stages  # first, last

    @property
    def certs(self) -> CertFiles:
        assert self.cluster.certs is not None
        return self.cluster.certs

    def client(self, token: str | None = USER) -> Client:
        return Client(self.cluster.address, token=token, ca_cert=self.certs.ca)

    def channel(self, target: str, role: str | None, *, certs: CertFiles | None = None) -> grpc.Channel:
        """A channel presenting `role`'s certificate (None: only trusting the CA)."""
        certs = certs or self.certs
        if role is None:
            return grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=certs.ca.read_bytes()))
        return grpc.secure_channel(target, certs.tls_files(role).channel_credentials())


@pytest.fixture(scope="module")
def secured(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    root = tmp_path_factory.mktemp("secured")
    (root / "api-tokens").write_text(f"{USER}\n")
    (root / "admin-tokens").write_text(f"{ADMIN}\n")
    plan = ClusterPlan(
        model=str(real_model_dir),
        port=free_port(),
        log_dir=root / "run",
        kv_memory="32M",
        tls=True,
        api_tokens=str(root / "api-tokens"),
        admin_tokens=str(root / "admin-tokens"),
        health_ports=True,
    )
    cluster = LocalCluster(plan, real_model_dir)
    cluster.start()
    try:
        status = cluster.wait_ready(timeout=180)
        with Client(cluster.address, token=USER, ca_cert=cluster.ca_cert) as client:
            reference = client.generate(PROMPT, max_tokens=8, temperature=0.0).token_ids
        yield Secured(cluster, reference, list(status.chains[0].addresses), status.chains[0].model_id)
    finally:
        cluster.stop()


def _code(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code()


def _health(channel: grpc.Channel) -> grpc.StatusCode | int:
    """The status code of a health check on `channel`, or the serving status when it answers."""
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    except grpc.RpcError as err:
        return err.code()


def test_member_ports_refuse_a_handshake_without_the_clusters_certificate(secured: Secured, tmp_path: Path) -> None:
    other = write_cluster_certs(tmp_path / "other-ca", ["127.0.0.1"])
    unavailable, serving = grpc.StatusCode.UNAVAILABLE, health_pb2.HealthCheckResponse.SERVING
    for target in (secured.stages[0], secured.cluster.cluster_address):
        with grpc.insecure_channel(target) as plaintext:
            assert _health(plaintext) == unavailable, target
        with secured.channel(target, None) as no_certificate:
            assert _health(no_certificate) == unavailable, target
        with secured.channel(target, "stage", certs=other) as another_ca:
            assert _health(another_ca) == unavailable, target
        with secured.channel(target, "stage") as member:
            assert _health(member) == serving, target


def test_the_health_port_answers_health_alone_in_plaintext(secured: Secured) -> None:
    """What Kubernetes' gRPC probes dial (they speak no TLS): SERVING, and no other service."""
    ports = secured.cluster.health_ports
    assert sorted(ports) == sorted(name for name, _ in secured.cluster.procs)  # the coordinator and each stage
    for name, port in ports.items():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as plaintext:
            assert _health(plaintext) == health_pb2.HealthCheckResponse.SERVING, name
            assert _other_services(plaintext) == [grpc.StatusCode.UNIMPLEMENTED] * 3, name


def _other_services(channel: grpc.Channel) -> list[grpc.StatusCode]:
    """The codes of a Register, an Info and a ClusterStatus call on `channel`."""
    worker = common_pb2.WorkerInfo(address="127.0.0.1:9", num_layers=30, layer_start=0, layer_end=30)
    registry = coordinator_pb2_grpc.RegistryStub(channel)
    stage = stage_pb2_grpc.StageWorkerStub(channel)
    client = coordinator_pb2_grpc.CoordinatorStub(channel)
    return [
        _code(lambda: registry.Register(coordinator_pb2.RegisterRequest(worker=worker), timeout=5)),
        _code(lambda: stage.Info(stage_pb2.InfoRequest(), timeout=5)),
        _code(lambda: client.ClusterStatus(coordinator_pb2.ClusterStatusRequest(), timeout=5)),
    ]


def test_each_call_is_allowed_by_the_callers_role(secured: Secured) -> None:
    first, last = secured.stages
    denied = grpc.StatusCode.PERMISSION_DENIED
    worker = common_pb2.WorkerInfo(address="127.0.0.1:9", num_layers=30, layer_start=0, layer_end=30)
    with secured.channel(secured.cluster.cluster_address, "client") as as_client:
        registry = coordinator_pb2_grpc.RegistryStub(as_client)
        assert _code(lambda: registry.Register(coordinator_pb2.RegisterRequest(worker=worker), timeout=5)) == denied
    with secured.channel(first, "client") as as_client:
        stage = stage_pb2_grpc.StageWorkerStub(as_client)
        assert _code(lambda: list(stage.Step(iter([_header_frame(secured, route=[last])]), timeout=5))) == denied
        assert _code(lambda: stage.Info(stage_pb2.InfoRequest(), timeout=5)) == denied
    with secured.channel(first, "stage") as as_stage:
        stage = stage_pb2_grpc.StageWorkerStub(as_stage)
        assert stage.Info(stage_pb2.InfoRequest(), timeout=5).worker.address == first  # members may ask
        assert _code(lambda: stage.Info(stage_pb2.InfoRequest(probe=True), timeout=5)) == denied
        assert _code(lambda: stage.Release(stage_pb2.ReleaseRequest(sequence_ids=["x"]), timeout=5)) == denied
        (result,) = stage.Step(iter([_header_frame(secured, route=[last])]), timeout=10)  # a stage cannot start a step
        assert result.error.code == denied.value[0]
    with secured.channel(last, "stage") as as_stage:
        results = stage_pb2_grpc.StageWorkerStub(as_stage).Results(
            stage_pb2.ResultsRequest(subscriber="the-coordinators-name"), timeout=5
        )
        assert _code(lambda: next(iter(results))) == denied


def test_client_calls_need_a_token_and_cluster_status_an_admin_token(secured: Secured) -> None:
    for token in (None, "wrong-token"):
        with secured.client(token) as client:
            with pytest.raises(Unauthenticated):
                client.generate(PROMPT, max_tokens=2)
            with pytest.raises(Unauthenticated):
                client.chat([{"role": "user", "content": "Hi"}], max_tokens=2)
            with pytest.raises(Unauthenticated):
                client.models()
            with pytest.raises(Unauthenticated):
                client.cluster()
            assert client.health() == "SERVING"  # health stays open
    with secured.client(USER) as user:
        with pytest.raises(PermissionDenied, match="needs an admin token"):
            user.cluster()
        assert user.models()[0].num_layers == 30
    with secured.client(ADMIN) as admin:
        status = admin.cluster()
    assert len(status.workers) == 2 and {w.instance_id for w in status.workers} == {""}


def test_hostile_requests_are_refused_and_the_cluster_then_answers_as_before(secured: Secured) -> None:
    first, last = secured.stages
    invalid, denied = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED
    garbage = b"\xff\xff\xff\xff\x0f"
    raw = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    auth = (("authorization", f"Bearer {ADMIN}"),)
    with secured.channel(secured.cluster.address, None) as to_clients:
        generate = to_clients.unary_stream("/layerline.v1.Coordinator/Generate", **raw)
        assert _code(lambda: list(generate(garbage, metadata=auth, timeout=5))) == invalid
        status = to_clients.unary_unary("/layerline.v1.Coordinator/ClusterStatus", **raw)
        assert _code(lambda: status(garbage, metadata=auth, timeout=5)) == invalid
    with secured.channel(secured.cluster.cluster_address, "stage") as as_stage:
        call = as_stage.unary_unary("/layerline.v1.Registry/Register", **raw)
        assert _code(lambda: call(garbage, timeout=5)) == invalid
    with secured.channel(last, "coordinator") as as_coordinator:
        call = as_coordinator.unary_unary("/layerline.v1.StageWorker/Info", **raw)
        assert _code(lambda: call(garbage, timeout=5)) == invalid
        step = as_coordinator.stream_stream("/layerline.v1.StageWorker/Step", **raw)
        assert _code(lambda: list(step(iter([garbage]), timeout=5))) == invalid
        overflow = tensor_pb2.TensorChunk(dtype=tensor_pb2.FLOAT32, shape=[2**62, 2**62, 0])
        (answer,) = stage_pb2_grpc.StageWorkerStub(as_coordinator).Step(
            iter([_header_frame(secured, route=[], hidden=overflow)]), timeout=10
        )
        assert answer.error.code == invalid.value[0], answer
    with secured.channel(first, "coordinator") as as_coordinator:  # its certificate, but not its route key
        (answer,) = stage_pb2_grpc.StageWorkerStub(as_coordinator).Step(
            iter([_header_frame(secured, route=["127.0.0.1:1"])]), timeout=10
        )
        assert answer.error.code == denied.value[0] and "route_tag" in answer.error.message, answer
    with secured.client(USER) as client:
        with pytest.raises(InvalidArgument, match="prompt"):
            client.generate("x" * (2 << 20), max_tokens=2)
        with pytest.raises(InvalidArgument, match="messages"):
            client.chat([{"role": "user", "content": "hi"}] * 10_000, max_tokens=2)
        again = client.generate(PROMPT, max_tokens=8, temperature=0.0).token_ids
    assert again == secured.reference


def test_run_with_tls_answers_the_quick_start(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "layerline", "run", "--tls", "--port", str(free_port()), "--max-tokens", "8", PROMPT],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Paris" in done.stdout
    assert "TLS: clients trust" in done.stderr


def _header_frame(
    secured: Secured, *, route: list[str], hidden: tensor_pb2.TensorChunk | None = None
) -> stage_pb2.StepFrame:
    header = stage_pb2.StepHeader(
        step_id=1,
        model_id=secured.model_id,
        sequences=[stage_pb2.SequenceInput(sequence_id="hostile", positions=[0], token_ids=[1])],
        route=route,
    )
    if hidden is not None:
        header.hidden.CopyFrom(hidden)
    return stage_pb2.StepFrame(header=header)
