"""Static checks of the docker files: no Docker engine and no network, in well under a second.

The Dockerfiles are read by a small line parser (instructions, continuation lines, ARG and ENV
references), the compose file by PyYAML, and every `layerline ...` command they start goes
through the real command-line parser: a renamed flag, a wrong port, a gap between layer ranges,
a torch that pip would take from PyPI, or a package directory the image forgets fails here
instead of in a container. The healthcheck script runs against a real gRPC health service.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import grpc
import pytest
import tomllib
import yaml  # PyYAML: installed with the [test] extra, through transformers
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from packaging.requirements import Requirement

from layerline.cli import build_parser
from layerline.shared.certs import CertFiles, write_cluster_certs

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
STAGE_DOCKERFILE = "docker/Dockerfile.stage"
COORDINATOR_DOCKERFILE = "docker/Dockerfile.coordinator"
SMOLLM2_LAYERS = 30  # num_hidden_layers of SmolLM2-135M-Instruct, the model compose.yaml serves
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


# --- reading a Dockerfile ------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction, its continuation lines joined and `$VAR`s expanded."""

    keyword: str  # upper case: "RUN", "COPY", ...
    args: str  # everything after the keyword


@dataclass(frozen=True)
class Dockerfile:
    instructions: tuple[Instruction, ...]
    variables: dict[str, str]  # ARG defaults and ENV values, as of the last instruction

    def all(self, keyword: str) -> list[str]:
        return [i.args for i in self.instructions if i.keyword == keyword]

    def one(self, keyword: str) -> str:
        found = self.all(keyword)
        assert len(found) == 1, f"expected one {keyword}, found {len(found)}"
        return found[0]

    def index(self, keyword: str) -> int:
        return next(n for n, i in enumerate(self.instructions) if i.keyword == keyword)

    def exec_form(self, keyword: str) -> list[str]:
        """The JSON-array form of `keyword` (ENTRYPOINT, CMD), which runs without a shell."""
        value = json.loads(self.one(keyword))
        assert isinstance(value, list) and all(isinstance(word, str) for word in value), value
        return value

    def healthcheck(self) -> tuple[dict[str, str], list[str]]:
        """The HEALTHCHECK's options (`--timeout` -> "5s") and its exec-form command."""
        options, found, command = self.one("HEALTHCHECK").partition(" CMD ")
        assert found, "HEALTHCHECK without CMD"
        flags = dict(word.removeprefix("--").split("=", 1) for word in options.split())
        return flags, json.loads(command)

    def pip_installs(self) -> list[str]:
        return [run for run in self.all("RUN") if "pip install" in run]

    def copies(self) -> list[tuple[list[str], str]]:
        """(sources, destination) of every COPY, the destination made absolute by WORKDIR."""
        out = []
        workdir = "/"
        for i in self.instructions:
            if i.keyword == "WORKDIR":
                workdir = i.args
            elif i.keyword == "COPY":
                *sources, dest = i.args.split()
                out.append((sources, dest if dest.startswith("/") else f"{workdir.rstrip('/')}/{dest}"))
        return out


def _expand(text: str, variables: dict[str, str]) -> str:
    """`${NAME}` and `$NAME` replaced by their ARG default or ENV value (unknown names are kept)."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables.get(m[1] or m[2], m[0]), text)


def read_dockerfile(relative: str) -> Dockerfile:
    lines: list[str] = []
    pending = ""
    for raw in (ROOT / relative).read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line.startswith("#") or not line:  # Docker drops comments even inside continuations
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        lines.append(pending + line)
        pending = ""
    assert not pending, f"{relative} ends inside a continuation"

    variables: dict[str, str] = {}
    instructions = []
    for line in lines:
        keyword, _, rest = line.partition(" ")
        args = _expand(rest.strip(), variables)
        if keyword.upper() == "ARG":
            name, _, default = args.partition("=")
            variables[name] = default
        elif keyword.upper() == "ENV":
            for pair in shlex.split(args):
                name, found, value = pair.partition("=")
                assert found, f"ENV {pair!r}: write ENV NAME=VALUE"
                variables[name] = value
        instructions.append(Instruction(keyword.upper(), args))
    return Dockerfile(tuple(instructions), variables)


STAGE = read_dockerfile(STAGE_DOCKERFILE)
COORDINATOR = read_dockerfile(COORDINATOR_DOCKERFILE)
IMAGES = {STAGE_DOCKERFILE: STAGE, COORDINATOR_DOCKERFILE: COORDINATOR}
# What `docker run IMAGE ...` must add to the image's ENTRYPOINT at least.
RUN_ARGS = {
    STAGE_DOCKERFILE: ["--model", "smollm2-135m-instruct", "--layers", "0:30"],
    COORDINATOR_DOCKERFILE: [],
}


# --- the real command-line parser ----------------------------------------------------------


class Rejected(Exception):
    """The `layerline` parser refused a command line; the message is argparse's."""


def parse(argv: list[str]) -> argparse.Namespace:
    """`argv` (starting with "layerline") parsed by the real parser; Rejected if it refuses."""
    assert argv[:1] == ["layerline"], f"not a layerline command: {argv}"
    assert all(isinstance(word, str) for word in argv), (
        f"non-string word in {argv}: quote it in YAML (YAML 1.1 reads 19:30 as 1170)"
    )

    def error(parser: argparse.ArgumentParser, message: str) -> None:
        raise Rejected(f"{parser.prog}: {message}")

    with mock.patch.object(argparse.ArgumentParser, "error", error):
        return build_parser().parse_args(argv[1:])


# --- the compose file ----------------------------------------------------------------------

COMPOSE = yaml.safe_load((DOCKER / "compose.yaml").read_text(encoding="utf-8"))
# layerline's own services (built from this repository); the tracing ones run published images.
SERVICES: dict[str, dict[str, Any]] = {n: s for n, s in COMPOSE["services"].items() if "build" in s}


def service_argv(name: str) -> list[str]:
    """What the service's container runs: its entrypoint (or the image's) and its command."""
    service = SERVICES[name]
    entrypoint = service.get("entrypoint") or IMAGES[service["build"]["dockerfile"]].exec_form("ENTRYPOINT")
    command = service.get("command", [])
    return list(entrypoint) + (shlex.split(command) if isinstance(command, str) else list(command))


def services_running(subcommand: str) -> Iterator[tuple[str, argparse.Namespace]]:
    for name in SERVICES:
        args = parse(service_argv(name))
        if args.command == subcommand:
            yield name, args


def load_healthcheck() -> ModuleType:
    """docker/healthcheck.py, imported as a module (docker/ is not a package)."""
    spec = importlib.util.spec_from_file_location("layerline_docker_healthcheck", DOCKER / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the images ----------------------------------------------------------------------------


def test_entrypoints_listen_on_all_interfaces_and_leave_the_model_to_the_run() -> None:
    entrypoint = STAGE.exec_form("ENTRYPOINT")
    with pytest.raises(Rejected, match=r"--model.*--layers"):
        parse(entrypoint)
    for dockerfile, command in (STAGE_DOCKERFILE, "stage"), (COORDINATOR_DOCKERFILE, "coordinator"):
        args = parse(IMAGES[dockerfile].exec_form("ENTRYPOINT") + RUN_ARGS[dockerfile])
        assert (args.command, args.host) == (command, "0.0.0.0"), "reachable from other containers"


@pytest.mark.parametrize("dockerfile", IMAGES)
def test_exposed_port_and_healthcheck_are_the_servers_port(dockerfile: str) -> None:
    image = IMAGES[dockerfile]
    args = parse(image.exec_form("ENTRYPOINT") + RUN_ARGS[dockerfile])
    ports = [args.port] + ([args.cluster_port] if args.command == "coordinator" else [])  # clients, the Registry
    assert image.one("EXPOSE").split() == [str(p) for p in ports]
    assert args.port != 0, "a free port chosen at start cannot be exposed or health-checked"

    options, command = image.healthcheck()
    assert command[-1] == f"127.0.0.1:{args.port}"
    script = command[-2]
    assert (["docker/healthcheck.py"], script) in image.copies(), f"{script} is not where the image copies it"
    assert float(options["timeout"].removesuffix("s")) > load_healthcheck().DEADLINE_SECONDS


def test_stage_image_installs_cpu_torch_pinned_before_the_worker_extra() -> None:
    installs = STAGE.pip_installs()
    torch_installs = [run for run in installs if "torch" in run]
    assert len(torch_installs) == 1, torch_installs
    words = shlex.split(torch_installs[0])
    assert words[words.index("--index-url") + 1] == TORCH_CPU_INDEX
    assert "torch==2.13.0" in words
    worker_torch = next(
        r for r in map(Requirement, PYPROJECT["project"]["optional-dependencies"]["worker"]) if r.name == "torch"
    )
    assert worker_torch.specifier.contains("2.13.0"), "the pinned torch must satisfy the [worker] extra"
    # Installed after the pinned torch, the extra finds torch there; before it, pip would take
    # a (CUDA) torch from PyPI.
    extra = next(n for n, run in enumerate(installs) if ".[worker]" in run)
    assert installs.index(torch_installs[0]) < extra


def test_coordinator_image_installs_no_torch() -> None:
    installs = COORDINATOR.pip_installs()
    assert any(".[coordinator]" in run for run in installs), installs
    assert not any(re.search(r"torch|\[(worker|server|test)\]", run) for run in installs), installs


@pytest.mark.parametrize("dockerfile", IMAGES)
def test_extras_installed_exist_in_pyproject(dockerfile: str) -> None:
    named = [extra for run in IMAGES[dockerfile].pip_installs() for extra in re.findall(r"\.\[(\w+)\]", run)]
    assert named
    assert set(named) <= set(PYPROJECT["project"]["optional-dependencies"])


def test_images_run_as_the_same_unprivileged_user_owning_the_model_cache() -> None:
    uids = set()
    for dockerfile, image in IMAGES.items():
        user = image.one("USER")
        assert user not in ("root", "0") and not user.startswith(("root:", "0:")), dockerfile
        assert image.index("USER") < image.index("ENTRYPOINT")
        created = next(run for run in image.all("RUN") if "useradd" in run)
        useradd = shlex.split(created.partition("useradd")[2].partition("&&")[0])
        uid = useradd[useradd.index("--uid") + 1]
        assert user == f"{uid}:{uid}", f"{dockerfile} runs as {user} but creates uid {uid} (numeric: DL3066)"
        uids.add(uid)
        name = useradd[-1]
        cache = image.variables["LAYERLINE_HOME"]
        assert json.loads(image.one("VOLUME")) == [cache], dockerfile
        assert f"chown {name}:{name} {cache} " in " ".join(shlex.split(created)) + " ", (
            "the volume must start owned by the user"
        )
    assert len(uids) == 1, f"both images share one cache volume: one uid, not {uids}"


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore `patterns` keep `path` out of the build context (last match wins)."""

    def regex(pattern: str) -> str:
        out = re.escape(pattern.strip("/"))
        out = out.replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        return out.replace(r"\?", "[^/]").replace(r"\[", "[").replace(r"\]", "]")

    prefixes = ["/".join(path.split("/")[:n]) for n in range(1, path.count("/") + 2)]
    ignored = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        if any(re.fullmatch(regex(pattern.removeprefix("!")), prefix) for prefix in prefixes):
            ignored = not keep
    return ignored


@pytest.mark.parametrize("dockerfile", IMAGES)
def test_image_copies_what_the_package_build_needs(dockerfile: str) -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = {source for sources, _ in IMAGES[dockerfile].copies() for source in sources}
    package_dirs = PYPROJECT["tool"]["setuptools"]["package-dir"].values()
    needed = {"pyproject.toml", PYPROJECT["project"]["readme"], *package_dirs}
    assert needed <= sources, f"{dockerfile} does not copy {needed - sources}"
    for source in sources:
        files = (
            [source]
            if (ROOT / source).is_file()
            else [
                p.relative_to(ROOT).as_posix()
                for p in (ROOT / source).rglob("*")
                if p.suffix in (".py", ".proto", ".pyi") and "__pycache__" not in p.parts
            ]
        )
        assert files, f"{source} is empty or missing"
        dropped = [f for f in files if _ignored(f, patterns)]
        assert not dropped, f".dockerignore drops files the build needs: {dropped}"
    for heavy in (".git", ".venv", "layerline/__pycache__/cli.cpython-311.pyc"):
        assert _ignored(heavy, patterns), heavy


def test_healthcheck_script_exits_0_only_when_serving() -> None:
    check = load_healthcheck()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert check.main([f"127.0.0.1:{port}"]) == 1
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert check.main([f"127.0.0.1:{port}"]) == 0
    finally:
        server.stop(None).wait()
    assert check.main([f"127.0.0.1:{port}"]) == 1  # nobody listens any more
    assert check.main([]) == 1  # Docker reserves exit code 2


def test_healthcheck_speaks_mutual_tls_when_the_tls_variables_are_set(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from layerline.shared.certs import write_cluster_certs

    certs = write_cluster_certs(tmp_path / "certs", ["stage-0-19"])
    check = load_healthcheck()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", certs.tls_files("stage").server_credentials(require_client_auth=True))
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert check.main([f"127.0.0.1:{port}"]) == 1  # plaintext against a TLS port
        monkeypatch.setenv("LAYERLINE_TLS_CA", str(certs.ca))
        assert check.main([f"127.0.0.1:{port}"]) == 1  # no client certificate: the handshake fails
        monkeypatch.setenv("LAYERLINE_TLS_CERT", str(certs.cert("stage")))
        monkeypatch.setenv("LAYERLINE_TLS_KEY", str(certs.key("stage")))
        assert check.main([f"127.0.0.1:{port}"]) == 0
    finally:
        server.stop(None).wait()


# --- the compose file ----------------------------------------------------------------------


def test_compose_commands_parse_with_the_cli() -> None:
    commands = {name: parse(service_argv(name)).command for name in SERVICES}
    assert commands == {"model": "model", "coordinator": "coordinator", "stage-0-19": "stage", "stage-19-30": "stage"}
    fetch = parse(service_argv("model"))
    assert fetch.model_command == "fetch"


def test_compose_stages_cover_every_layer_of_one_model_once() -> None:
    stages = dict(services_running("stage"))
    ranges = sorted(tuple(map(int, args.layers.split(":"))) for args in stages.values())
    assert ranges[0][0] == 0 and ranges[-1][1] == SMOLLM2_LAYERS, ranges
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)), f"gap or overlap in {ranges}"
    assert all(start < end for start, end in ranges), ranges

    ((_, coordinator),) = services_running("coordinator")
    fetched = parse(service_argv("model")).name
    assert {args.model for args in stages.values()} == {coordinator.model} == {fetched}


def test_compose_addresses_and_ports_agree_with_the_flags() -> None:
    ((coordinator_name, coordinator),) = services_running("coordinator")
    assert coordinator.host == "0.0.0.0"
    for name, args in services_running("stage"):
        assert args.host == "0.0.0.0", name
        assert args.coordinator == f"{coordinator_name}:{coordinator.cluster_port}", name  # the Registry's port
        assert args.advertise == f"{name}:{args.port}", f"{name} must advertise its own service name and port"

    published = {name: service["ports"] for name, service in SERVICES.items() if "ports" in service}
    assert list(published) == [coordinator_name], "publish only the coordinator's client port"
    (mapping,) = published[coordinator_name]
    host_ip, host_port, container_port = mapping.split(":")
    assert (host_ip, int(container_port)) == ("127.0.0.1", coordinator.port)
    assert int(host_port) == coordinator.port  # the port the README's client commands use


def test_compose_start_order() -> None:
    fetched = {"model": {"condition": "service_completed_successfully"}}
    assert SERVICES["coordinator"]["depends_on"] == fetched
    for name, _ in services_running("stage"):
        assert SERVICES[name]["depends_on"] == {**fetched, "coordinator": {"condition": "service_healthy"}}
    # service_healthy needs a healthcheck: the image's, not disabled by the service.
    assert "HEALTHCHECK" in {i.keyword for i in COORDINATOR.instructions}
    assert "healthcheck" not in SERVICES["coordinator"]


def test_compose_builds_from_the_repository_root_and_shares_one_cache() -> None:
    builds: dict[str, dict[str, str]] = {}
    for name, service in SERVICES.items():
        build = service["build"]
        assert (DOCKER / build["context"]).resolve() == ROOT, name
        assert (ROOT / build["dockerfile"]).is_file(), name
        assert builds.setdefault(service["image"], build) == build, f"{service['image']} built two ways"

        cache = IMAGES[build["dockerfile"]].variables["LAYERLINE_HOME"]
        assert service["volumes"] == [f"models:{cache}"], name
    assert set(COMPOSE["volumes"]) == {"models"}


def test_compose_members_talk_mutual_tls_with_their_roles_certificates_as_secrets() -> None:
    declared = COMPOSE["secrets"]
    assert {name: spec["file"].removeprefix("./certs/") for name, spec in declared.items()} == {
        "tls_ca": "ca.crt",
        "tls_coordinator_cert": "coordinator.crt",
        "tls_coordinator_key": "coordinator.key",
        "tls_stage_cert": "stage.crt",
        "tls_stage_key": "stage.key",
        "api_tokens": "api-tokens",
    }
    for name, role in [("coordinator", "coordinator"), *((n, "stage") for n, _ in services_running("stage"))]:
        service = SERVICES[name]
        env = service["environment"]
        files = {env["LAYERLINE_TLS_CA"], env["LAYERLINE_TLS_CERT"], env["LAYERLINE_TLS_KEY"]}
        assert files == {f"/run/secrets/{s}" for s in ("tls_ca", f"tls_{role}_cert", f"tls_{role}_key")}, name
        assert {f"/run/secrets/{s}" for s in service["secrets"]} >= files, f"{name} mounts its role's secrets only"
        assert not any("coordinator_key" in s for s in service["secrets"]) or role == "coordinator", name
    ((_, coordinator),) = services_running("coordinator")
    assert coordinator.api_tokens == "/run/secrets/api_tokens" and "api_tokens" in SERVICES["coordinator"]["secrets"]
    assert "docker/certs" in (ROOT / ".dockerignore").read_text(), "keys never enter an image's build context"
    assert "docker/certs/" in (ROOT / ".gitignore").read_text()


def test_the_readmes_certificates_verify_every_name_a_member_is_dialled_by(tmp_path: Path) -> None:
    """`layerline certs` with the guides' --hosts for compose, then real TLS handshakes on
    127.0.0.1 under each name dialled: each stage's advertised service name, the coordinator's
    service name (stages register there) and localhost (clients, through the published port)."""
    lines = {
        shlex.split(doc.read_text().partition("layerline certs docker/certs")[2].splitlines()[0])[1]
        for doc in (ROOT / "README.md", ROOT / "docs" / "deploy.md")
    }
    assert len(lines) == 1, f"the README and the deploy guide make different certificates: {lines}"
    hosts = lines.pop().split(",")
    certs = write_cluster_certs(tmp_path, hosts)
    ((coordinator_name, _),) = services_running("coordinator")
    stages = [args.advertise.rpartition(":")[0] for _, args in services_running("stage")]
    assert len(stages) == 2
    dialled = [("coordinator", coordinator_name), ("coordinator", "localhost"), *(("stage", s) for s in stages)]
    for role, name in dialled:
        assert handshake(certs, role, name), f"the {role} certificate does not verify {name!r}"
    assert not handshake(certs, "stage", "stage-0-30")


def handshake(certs: CertFiles, role: str, name: str) -> bool:
    """Whether a client of the cluster CA reaches a health service that presents `role`'s
    certificate when it verifies the name `name`."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", certs.tls_files(role).server_credentials(require_client_auth=True))
    server.start()
    try:
        options = [("grpc.ssl_target_name_override", name)]
        credentials = certs.tls_files("client").channel_credentials()
        with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=options) as channel:
            try:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                return False
        return True
    finally:
        server.stop(None)


# --- real validators ----------------------------------------------------------------------


def _tool(name: str) -> str:
    """A validator installed with the test extra, beside this Python."""
    path = Path(sys.executable).parent / name
    assert path.exists(), f"{name} is missing: install the [test] extra"
    return str(path)


@pytest.mark.parametrize("dockerfile", IMAGES)
def test_hadolint_passes_every_dockerfile(dockerfile: str) -> None:
    done = subprocess.run([_tool("hadolint"), str(ROOT / dockerfile)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hadolint_finds_a_dockerfile_mistake(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim\nRUN cd /tmp && pip install grpcio\nUSER root\n")
    done = subprocess.run([_tool("hadolint"), str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "DL3003" in done.stdout  # `cd` instead of WORKDIR


def test_compose_file_matches_the_compose_specification(tmp_path: Path) -> None:
    command = [_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec"]
    done = subprocess.run([*command, str(DOCKER / "compose.yaml")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    broken = dict(COMPOSE, services={**COMPOSE["services"], "coordinator": {**SERVICES["coordinator"], "ports": 7070}})
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(broken))
    done = subprocess.run([*command, str(tmp_path / "compose.yaml")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, "the schema must refuse ports that are not a list"


def test_compose_sends_every_processs_traces_through_the_collector_to_jaeger() -> None:
    collector = COMPOSE["services"]["otel-collector"]
    config_path = next(v.split(":")[0] for v in collector["volumes"] if v.endswith(":/etc/otelcol/config.yaml:ro"))
    config = yaml.safe_load((DOCKER / config_path).read_text())
    receiver_port = int(config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rpartition(":")[2])
    assert config["service"]["pipelines"]["traces"]["exporters"] == ["otlp/jaeger"]
    assert config["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"
    assert COMPOSE["services"]["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert COMPOSE["services"]["jaeger"]["ports"] == ["127.0.0.1:16686:16686"], "the UI, on the loopback only"
    for name in SERVICES:
        args = parse(service_argv(name))
        if args.command in ("coordinator", "stage"):
            assert (args.trace, args.otlp_endpoint) == ("otlp", f"otel-collector:{receiver_port}"), name
