"""The Kubernetes manifests (k8s/), rendered and checked with real validators and the real CLI.

No Kubernetes cluster runs on these machines. What is checked instead: the Kustomize base and
the GPU overlay are rendered (the subset of Kustomize they use: resources, labels, images,
JSON 6902 patches; anything else fails here) and every object passes `kubernetes-validate`'s
schemas (strict: no unknown field); every container's command parses with `layerline`'s own
parser, and its ports, probes, advertised address, coordinator address and certificate paths
agree with the flags, the Services and the Secrets.
"""

from __future__ import annotations

import copy
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from layerline.cli import build_parser
from layerline.shared.certs import write_cluster_certs

from .test_docker import IMAGES, ROOT, handshake

K8S = ROOT / "k8s"
KUBERNETES_VERSION = "1.30.0"
NAMESPACE = "serving"  # the guide's $NS, as a user would set it
KNOWN_KEYS = {"apiVersion", "kind", "resources", "labels", "images", "patches"}


def render(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize directory`, for the features these manifests use."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(spec) <= KNOWN_KEYS, f"{directory}: this renderer does not know {set(spec) - KNOWN_KEYS}"
    objects: list[dict[str, Any]] = []
    for resource in spec.get("resources", []):
        path = directory / resource
        if path.is_dir():
            objects += render(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for label in spec.get("labels", []):
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(label["pairs"])
    for image in spec.get("images", []):
        for container in (c for obj in objects for c in _containers(obj)):
            if container["image"].partition(":")[0] == image["name"]:
                container["image"] = f"{image['name']}:{image['newTag']}"
    for patch in spec.get("patches", []):
        operations = yaml.safe_load((directory / patch["path"]).read_text())
        for obj in objects:
            if _targeted(obj, patch["target"]):
                for op in operations:
                    _apply(obj, op)
    return objects


def _targeted(obj: dict[str, Any], target: dict[str, str]) -> bool:
    if obj["kind"] != target.get("kind", obj["kind"]):
        return False
    key, _, value = target.get("labelSelector", "=").partition("=")
    return not key or obj["metadata"].get("labels", {}).get(key) == value


def _apply(obj: dict[str, Any], op: dict[str, Any]) -> None:
    assert op["op"] == "add", f"this renderer applies only 'add', not {op['op']}"
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].strip("/").split("/")]
    node: Any = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        node.append(op["value"]) if last == "-" else node.insert(int(last), op["value"])
    else:
        node[last] = copy.deepcopy(op["value"])


def _containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    return [*pod.get("initContainers", []), *pod.get("containers", [])]


BASE, GPU = render(K8S / "base"), render(K8S / "overlays" / "gpu")


def _by(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def _main(obj: dict[str, Any]) -> dict[str, Any]:
    (container,) = obj["spec"]["template"]["spec"]["containers"]
    return container


def _args(container: dict[str, Any]) -> Any:
    """The container's command line, parsed by `layerline`'s parser (its image's entrypoint first)."""
    dockerfile = f"docker/Dockerfile.{'coordinator' if 'coordinator' in container['image'] else 'stage'}"
    entrypoint = IMAGES[dockerfile].exec_form("ENTRYPOINT")
    command = container.get("command") or entrypoint
    return build_parser().parse_args([*command[1:], *container.get("args", [])])


@pytest.mark.parametrize("objects", [BASE, GPU], ids=["base", "gpu"])
def test_every_rendered_object_is_valid_kubernetes(objects: list[dict[str, Any]]) -> None:
    assert {o["kind"] for o in objects} == {"Deployment", "Service", "StatefulSet", "PodDisruptionBudget"}
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "layerline"


def test_a_broken_manifest_is_caught() -> None:
    broken = copy.deepcopy(_by(BASE, "Deployment")["layerline-coordinator"])
    _main(broken)["ports"][0]["containerPort"] = "seventy"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_coordinator_serves_clients_members_and_probes_on_the_ports_its_flags_name() -> None:
    deployment = _by(BASE, "Deployment")["layerline-coordinator"]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}, "never two coordinators, each with half the stages"
    container = _main(deployment)
    args = _args(container)
    assert args.command == "coordinator" and args.host == "0.0.0.0"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"client": args.port, "cluster": args.cluster_port, "health": args.health_port}
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"] == {"port": args.health_port}, "probes speak plaintext gRPC health"
    service = _by(BASE, "Service")["layerline-coordinator"]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "client": args.port,
        "cluster": args.cluster_port,
    }
    _tls_from_secret(deployment, "layerline-coordinator-tls")
    tokens = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["tokens"]
    assert args.api_tokens.startswith(tokens + "/") and args.admin_tokens.startswith(tokens + "/")
    (fetch,) = deployment["spec"]["template"]["spec"]["initContainers"]
    fetched = build_parser().parse_args(fetch["command"][1:])
    assert (fetched.command, fetched.model_command, fetched.name) == ("model", "fetch", args.model)


@pytest.mark.parametrize("objects", [BASE, GPU], ids=["base", "gpu"])
def test_each_stage_range_advertises_its_pod_and_registers_at_the_coordinator(objects: list[dict[str, Any]]) -> None:
    coordinator = _args(_main(_by(objects, "Deployment")["layerline-coordinator"]))
    ranges = []
    for statefulset in _by(objects, "StatefulSet").values():
        args = _args(_main(statefulset))
        ranges.append(tuple(map(int, args.layers.split(":"))))
        assert args.command == "stage" and args.model == coordinator.model
        assert args.coordinator == f"layerline-coordinator:{coordinator.cluster_port}"
        service = _by(objects, "Service")[statefulset["spec"]["serviceName"]]
        assert service["spec"]["clusterIP"] == "None", "a headless Service gives each pod its own name"
        assert args.advertise == f"$(POD_NAME).{service['metadata']['name']}.$(POD_NAMESPACE).svc:{args.port}"
        env = {
            e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in _main(statefulset)["env"]
        }
        assert (env["POD_NAME"], env["POD_NAMESPACE"]) == ("metadata.name", "metadata.namespace")
        ports = {p["name"]: p["containerPort"] for p in _main(statefulset)["ports"]}
        assert ports == {"stage": args.port, "health": args.health_port}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert _main(statefulset)[probe]["grpc"] == {"port": args.health_port}
        _tls_from_secret(statefulset, "layerline-stage-tls")
        assert statefulset["spec"]["replicas"] >= 2, "a range of one pod loses every chain to a drain"
    assert sorted(ranges) == [(0, 19), (19, 30)]
    # One budget over every stage pod (the eviction API refuses a pod that two budgets select):
    # a drain takes one stage pod at a time, so with two pods per range a whole chain remains.
    (budget,) = _by(objects, "PodDisruptionBudget").values()
    assert budget["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": {"app.kubernetes.io/component": "stage"}},
    }
    for statefulset in _by(objects, "StatefulSet").values():
        labels = statefulset["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == "stage"
    coordinator_labels = _by(objects, "Deployment")["layerline-coordinator"]["spec"]["template"]["metadata"]["labels"]
    assert coordinator_labels.get("app.kubernetes.io/component") != "stage"


def test_the_gpu_overlay_asks_each_stage_for_a_gpu_and_shared_memory() -> None:
    for statefulset in _by(GPU, "StatefulSet").values():
        container = _main(statefulset)
        assert _args(container).device == "cuda"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container["image"] == "layerline-stage:cuda"
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in statefulset["spec"]["template"]["spec"]["volumes"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    for statefulset in _by(BASE, "StatefulSet").values():
        assert "nvidia.com/gpu" not in _main(statefulset)["resources"]["limits"]


def test_the_deploy_guide_names_the_secrets_the_manifests_mount() -> None:
    guide = (ROOT / "docs" / "deploy.md").read_text()
    secrets = {
        v["secret"]["secretName"]
        for obj in BASE
        for v in obj.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", [])
        if "secret" in v
    }
    assert secrets == {"layerline-coordinator-tls", "layerline-stage-tls", "layerline-api-tokens"}
    for secret in secrets:
        assert f"kubectl create secret generic {secret}" in guide, secret
    hosts = shlex.split(guide.partition("layerline certs k8s-certs")[2].splitlines()[0])
    assert hosts[0] == "--hosts"
    assert {"layerline-coordinator", "*.layerline-stage-0-19.$NS.svc", "*.layerline-stage-19-30.$NS.svc"} <= set(
        hosts[1].split(",")
    )


def _tls_from_secret(obj: dict[str, Any], secret: str) -> None:
    """The container's --tls-* defaults point into the volume of `secret`."""
    container = _main(obj)
    env = {e["name"]: e.get("value") for e in container["env"]}
    volumes = {v["name"]: v for v in obj["spec"]["template"]["spec"]["volumes"]}
    mount = next(
        m for m in container["volumeMounts"] if volumes[m["name"]].get("secret", {}).get("secretName") == secret
    )
    assert {env["LAYERLINE_TLS_CA"], env["LAYERLINE_TLS_CERT"], env["LAYERLINE_TLS_KEY"]} == {
        f"{mount['mountPath']}/{name}" for name in ("ca.crt", "tls.crt", "tls.key")
    }


def test_the_guides_certificates_verify_every_name_a_member_is_dialled_by(tmp_path: Path) -> None:
    """`layerline certs` with the guide's --hosts, then real TLS handshakes on 127.0.0.1 under each
    name the manifests dial: every pod of a range by its advertised name, the coordinator by the
    host of the stages' --coordinator. A name outside them fails the handshake."""
    guide = (ROOT / "docs" / "deploy.md").read_text()
    line = guide.partition("layerline certs k8s-certs")[2].splitlines()[0].replace("$NS", NAMESPACE)
    certs = write_cluster_certs(tmp_path, shlex.split(line)[1].split(","))
    dialled: dict[str, list[str]] = {"coordinator": [], "stage": []}
    for name, statefulset in _by(BASE, "StatefulSet").items():
        args = _args(_main(statefulset))
        pods = [f"{name}-{i}" for i in range(statefulset["spec"]["replicas"])]
        advertised = args.advertise.replace("$(POD_NAMESPACE)", NAMESPACE)
        dialled["stage"] += [advertised.replace("$(POD_NAME)", pod).rpartition(":")[0] for pod in pods]
        dialled["coordinator"].append(args.coordinator.rpartition(":")[0])
    assert dialled["stage"] and dialled["coordinator"] == ["layerline-coordinator"] * 2
    for role, names in dialled.items():
        for name in names:
            assert handshake(certs, role, name), f"the {role} certificate does not verify {name!r}"
    assert not handshake(certs, "stage", f"layerline-stage-0-19-0.layerline-stage-0-19.{NAMESPACE}-2.svc")
