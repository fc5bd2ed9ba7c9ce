"""What to run for a recommended layout: a `layerline up` command, a compose file or Kubernetes manifests.

Owns the text of each. `up` starts the whole layout on one machine, told to split the layers as
the plan does (`--split weights`: the LM head weighed by its bytes, not measured again). The
compose file and the manifests follow docker/compose.yaml and k8s/base: one service
(StatefulSet) per stage with its `--layers`, `--tp` ranks (a GPU each on GPU devices) and
`--dtype`, registering at the coordinator; replicas are more containers (pods) of each stage.
They leave out the TLS secrets and telemetry that the shipped files add: see docker/ and k8s/
for those.
"""

from __future__ import annotations

import json
import shlex

from .predict import Layout

STAGE_PORT = 7100
CLUSTER_PORT = 7071
CLIENT_PORT = 7070
STAGE_IMAGE = "layerline-stage"
COORDINATOR_IMAGE = "layerline-coordinator"


def kv_memory(kv_bytes: int) -> str:
    """A stage's --kv-memory for a predicted KV cache: whole MiB, at least 16."""
    return f"{max(16, -(-kv_bytes // 2**20))}M"


def up_command(model: str, layout: Layout, *, dtype: str, kv_bytes: int) -> list[str]:
    """`layerline up` for `layout` on this machine, as an argument list."""
    return [
        "layerline",
        "up",
        "--model",
        model,
        "--stages",
        str(layout.pp),
        "--split",
        "weights",
        "--tp",
        str(layout.tp),
        "--replicas",
        str(layout.dp),
        "--dtype",
        dtype,
        "--kv-memory",
        kv_memory(kv_bytes),
    ]


def up_text(model: str, layout: Layout, *, dtype: str, kv_bytes: int) -> str:
    return shlex.join(up_command(model, layout, dtype=dtype, kv_bytes=kv_bytes)) + "\n"


def _stage_args(
    model: str, start: int, end: int, layout: Layout, *, dtype: str, advertise: str, kv_bytes: int, gpu: bool
) -> list[str]:
    args = ["--model", model, "--layers", f"{start}:{end}", "--dtype", dtype, "--kv-memory", kv_memory(kv_bytes)]
    args += ["--coordinator", f"coordinator:{CLUSTER_PORT}", "--advertise", advertise]
    args += ["--device", "cuda"] if gpu else []
    return args + (["--tp", str(layout.tp)] if layout.tp > 1 else [])


def _flow(items: list[str]) -> str:
    return json.dumps(items)  # a JSON list is a YAML flow sequence


def compose_text(model: str, layout: Layout, *, dtype: str, gpu: bool, kv_bytes: int) -> str:
    """A compose file: a coordinator and, per replica, one service per stage."""
    lines = [
        f"# layerline plan: tp {layout.tp} x pp {layout.pp} x dp {layout.dp} of {model} in {dtype}.",
        "# Build the images from the repository root as docker/compose.yaml does; add its TLS secrets for",
        "# anything beyond a trusted network.",
        "name: layerline-plan",
        "services:",
        "  model:",
        f"    image: {STAGE_IMAGE}",
        f"    entrypoint: {_flow(['layerline', 'model', 'fetch'])}",
        f"    command: {_flow([model])}",
        "    volumes:",
        "      - models:/var/cache/layerline",
        "  coordinator:",
        f"    image: {COORDINATOR_IMAGE}",
        "    init: true",
        f"    command: {_flow(['--model', model])}",
        "    volumes:",
        "      - models:/var/cache/layerline",
        "    ports:",
        f'      - "127.0.0.1:{CLIENT_PORT}:{CLIENT_PORT}"',
        "    depends_on:",
        "      model:",
        "        condition: service_completed_successfully",
    ]
    for replica in range(layout.dp):
        for start, end in layout.layers:
            name = f"stage-r{replica}-{start}-{end}"
            args = _stage_args(
                model, start, end, layout, dtype=dtype, advertise=f"{name}:{STAGE_PORT}", kv_bytes=kv_bytes, gpu=gpu
            )
            lines += [
                f"  {name}:",
                f"    image: {STAGE_IMAGE}",
                "    init: true",
                f"    command: {_flow(args)}",
                "    volumes:",
                "      - models:/var/cache/layerline",
                "    depends_on:",
                "      model:",
                "        condition: service_completed_successfully",
                "      coordinator:",
                "        condition: service_started",
            ]
            if gpu:
                lines += [
                    "    deploy:",
                    "      resources:",
                    "        reservations:",
                    "          devices:",
                    f"            - {{driver: nvidia, count: {layout.tp}, capabilities: [gpu]}}",
                ]
    lines += ["volumes:", "  models: {}"]
    return "\n".join(lines) + "\n"


def k8s_text(model: str, layout: Layout, *, dtype: str, gpu: bool, kv_bytes: int) -> str:
    """Manifests: a StatefulSet and a headless Service per stage (dp pods each), and the coordinator."""
    docs = [_coordinator_manifest(model)]
    for start, end in layout.layers:
        name = f"layerline-stage-{start}-{end}"
        advertise = f"$(POD_NAME).{name}.$(POD_NAMESPACE).svc:{STAGE_PORT}"
        args = _stage_args(model, start, end, layout, dtype=dtype, advertise=advertise, kv_bytes=kv_bytes, gpu=gpu)
        args[args.index(f"coordinator:{CLUSTER_PORT}")] = f"layerline-coordinator:{CLUSTER_PORT}"
        resources = f"{{limits: {{nvidia.com/gpu: {layout.tp}}}}}" if gpu else '{requests: {cpu: "1", memory: 2Gi}}'
        docs.append(
            "\n".join(
                [
                    "apiVersion: apps/v1",
                    "kind: StatefulSet",
                    "metadata:",
                    f"  name: {name}",
                    "spec:",
                    f"  serviceName: {name}",
                    f"  replicas: {layout.dp}",
                    "  podManagementPolicy: Parallel",
                    "  selector:",
                    f"    matchLabels: {{app.kubernetes.io/name: {name}}}",
                    "  template:",
                    "    metadata:",
                    f"      labels: {{app.kubernetes.io/name: {name}, app.kubernetes.io/component: stage}}",
                    "    spec:",
                    "      securityContext: {runAsNonRoot: true, runAsUser: 10001, runAsGroup: 10001, fsGroup: 10001}",
                    "      containers:",
                    "        - name: stage",
                    f"          image: {STAGE_IMAGE}",
                    f"          args: {_flow(args)}",
                    "          env:",
                    "            - name: POD_NAME",
                    "              valueFrom: {fieldRef: {fieldPath: metadata.name}}",
                    "            - name: POD_NAMESPACE",
                    "              valueFrom: {fieldRef: {fieldPath: metadata.namespace}}",
                    f"          ports: [{{name: stage, containerPort: {STAGE_PORT}}}]",
                    f"          resources: {resources}",
                    "---",
                    "apiVersion: v1",
                    "kind: Service",
                    "metadata:",
                    f"  name: {name}",
                    "spec:",
                    "  clusterIP: None",
                    "  publishNotReadyAddresses: true",
                    f"  selector: {{app.kubernetes.io/name: {name}}}",
                    f"  ports: [{{name: stage, port: {STAGE_PORT}, targetPort: stage}}]",
                ]
            )
        )
    return "\n---\n".join(docs) + "\n"


def _coordinator_manifest(model: str) -> str:
    name = "layerline-coordinator"
    return "\n".join(
        [
            f"# layerline plan: the coordinator; clients connect to {name}:{CLIENT_PORT}.",
            "apiVersion: apps/v1",
            "kind: Deployment",
            "metadata:",
            f"  name: {name}",
            "spec:",
            "  replicas: 1",
            "  selector:",
            f"    matchLabels: {{app.kubernetes.io/name: {name}}}",
            "  template:",
            "    metadata:",
            f"      labels: {{app.kubernetes.io/name: {name}}}",
            "    spec:",
            "      securityContext: {runAsNonRoot: true, runAsUser: 10001, runAsGroup: 10001, fsGroup: 10001}",
            "      containers:",
            "        - name: coordinator",
            f"          image: {COORDINATOR_IMAGE}",
            f"          args: {_flow(['--model', model])}",
            "          ports:",
            f"            - {{name: client, containerPort: {CLIENT_PORT}}}",
            f"            - {{name: cluster, containerPort: {CLUSTER_PORT}}}",
            "---",
            "apiVersion: v1",
            "kind: Service",
            "metadata:",
            f"  name: {name}",
            "spec:",
            f"  selector: {{app.kubernetes.io/name: {name}}}",
            "  ports:",
            f"    - {{name: client, port: {CLIENT_PORT}, targetPort: client}}",
            f"    - {{name: cluster, port: {CLUSTER_PORT}, targetPort: cluster}}",
        ]
    )
