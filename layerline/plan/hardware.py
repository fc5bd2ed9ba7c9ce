"""The devices and links a plan can use: a small catalog of GPUs and interconnects, and the parsing
of `--devices` and `--links`.

Owns the public figures of each device (memory, memory bandwidth, dense matmul rate per dtype) and
link (rate per direction, latency), and what a spec string means. This machine itself is the device
`cpu`, whose figures are measured (`profile.py`), not listed. Knows nothing of models or layouts.

Sources of the catalog (vendor datasheets, dense figures, i.e. without structured sparsity):
- H100 SXM5 80GB: NVIDIA H100 Tensor Core GPU datasheet: 80 GB HBM3, 3.35 TB/s, BF16/FP16 989 TFLOPS.
- H200 SXM 141GB: NVIDIA H200 product page: 141 GB HBM3e, 4.8 TB/s, BF16/FP16 989 TFLOPS.
- A100 SXM 80GB: NVIDIA A100 datasheet: 80 GB HBM2e, 2,039 GB/s, BF16/FP16 312 TFLOPS.
- L4: NVIDIA L4 datasheet: 24 GB GDDR6, 300 GB/s, BF16/FP16 121 TFLOPS (242 is with sparsity).
- GeForce RTX 4090: NVIDIA Ada Lovelace architecture whitepaper: 24 GB GDDR6X, 1,008 GB/s,
  FP16/BF16 tensor with FP32 accumulate 165.2 TFLOPS.
- FP32 (non-tensor) rates from the same sheets: H100 67, H200 67, A100 19.5, L4 30.3, RTX 4090 82.6 TFLOPS.
- Links: NVLink 4 (H100/H200) 900 GB/s and NVLink 3 (A100) 600 GB/s total per GPU, so half each way;
  PCIe 4.0 x16 32 GB/s and PCIe 5.0 x16 64 GB/s per direction; Ethernet at its line rate;
  InfiniBand NDR 400 Gbit/s. Latencies are typical one-way figures, not from a datasheet.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GB = 10**9
TFLOPS = 10**12


class SpecError(ValueError):
    """A `--devices` or `--links` spec that names no known device or link, or is malformed."""


@dataclass(frozen=True)
class Device:
    name: str
    memory_bytes: int  # on-device memory
    bandwidth_bytes_s: float  # memory bandwidth
    flops: dict[str, float]  # dense matmul rate per dtype name, per second
    link: str  # the catalog link between two of these in one node


@dataclass(frozen=True)
class Link:
    name: str
    bytes_per_s: float  # per direction
    latency_s: float  # one way


CATALOG: dict[str, Device] = {
    d.name.lower(): d
    for d in (
        Device(
            "H100",
            80 * GB,
            3350 * GB,
            {"bfloat16": 989 * TFLOPS, "float16": 989 * TFLOPS, "float32": 67 * TFLOPS},
            "nvlink4",
        ),
        Device(
            "H200",
            141 * GB,
            4800 * GB,
            {"bfloat16": 989 * TFLOPS, "float16": 989 * TFLOPS, "float32": 67 * TFLOPS},
            "nvlink4",
        ),
        Device(
            "A100",
            80 * GB,
            2039 * GB,
            {"bfloat16": 312 * TFLOPS, "float16": 312 * TFLOPS, "float32": 19.5 * TFLOPS},
            "nvlink3",
        ),
        Device(
            "L4",
            24 * GB,
            300 * GB,
            {"bfloat16": 121 * TFLOPS, "float16": 121 * TFLOPS, "float32": 30.3 * TFLOPS},
            "pcie4",
        ),
        Device(
            "RTX4090",
            24 * GB,
            1008 * GB,
            {"bfloat16": 165.2 * TFLOPS, "float16": 165.2 * TFLOPS, "float32": 82.6 * TFLOPS},
            "pcie4",
        ),
    )
}
ALIASES = {"h100-sxm": "h100", "a100-80gb": "a100", "4090": "rtx4090", "rtx-4090": "rtx4090"}

LINKS: dict[str, Link] = {
    link.name: link
    for link in (
        Link("nvlink4", 450 * GB, 5e-6),
        Link("nvlink3", 300 * GB, 5e-6),
        Link("pcie4", 32 * GB, 10e-6),
        Link("pcie5", 64 * GB, 10e-6),
        Link("eth1", 0.125 * GB, 100e-6),
        Link("eth10", 1.25 * GB, 50e-6),
        Link("eth25", 3.125 * GB, 30e-6),
        Link("eth100", 12.5 * GB, 20e-6),
        Link("ib400", 50 * GB, 5e-6),
    )
}
DEFAULT_INTER_NODE = "eth100"  # between GPU nodes, unless --links says otherwise
DEFAULT_INTER_HOST = "eth10"  # between CPU hosts
CPU = "cpu"  # this machine, as measured by `layerline plan --calibrate`


@dataclass(frozen=True)
class Node:
    device: str  # a catalog key, or CPU
    count: int  # devices in the node (CPU: 1, the whole machine)


def parse_devices(spec: str) -> tuple[Node, ...]:
    """`2xH100` one node of two; `4xL4,4xL4` two nodes of four; `cpu` this machine; `cpu,cpu` two like it."""
    nodes = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(?:(\d+)\s*x\s*)?([A-Za-z0-9_-]+)\s*", part)
        if not match:
            raise SpecError(f"--devices {spec!r}: {part!r} is not COUNTxNAME, e.g. 2xH100")
        count = int(match.group(1) or 1)
        name = ALIASES.get(match.group(2).lower(), match.group(2).lower())
        if name == CPU:
            nodes += [Node(CPU, 1)] * count  # NxCPU: N hosts like this one
            continue
        if name not in CATALOG:
            known = ", ".join([*(d.name for d in CATALOG.values()), CPU])
            raise SpecError(f"--devices {spec!r}: unknown device {match.group(2)!r}; known: {known}")
        if not 1 <= count <= 64:
            raise SpecError(f"--devices {spec!r}: {count} devices in one node; allowed 1 to 64")
        nodes.append(Node(name, count))
    kinds = {n.device for n in nodes}
    if len(kinds) > 1:
        raise SpecError(f"--devices {spec!r}: every node must hold the same device (got {', '.join(sorted(kinds))})")
    return tuple(nodes)


_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*(gbit|mbit|gb|mb)", re.IGNORECASE)
_LATENCY = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|us)", re.IGNORECASE)


def parse_link(text: str) -> Link:
    """A catalog link name, or `RATE:LATENCY` such as `1gbit:5ms` or `25gbit:50us` (latency one way)."""
    name = text.strip().lower()
    if name in LINKS:
        return LINKS[name]
    rate_text, _, latency_text = name.partition(":")
    rate, latency = _RATE.fullmatch(rate_text), _LATENCY.fullmatch(latency_text or "0ms")
    if rate is None or latency is None:
        raise SpecError(
            f"--links {text!r} is neither a known link ({', '.join(LINKS)}) nor RATE:LATENCY such as 1gbit:5ms"
        )
    scale = {"gbit": GB / 8, "mbit": GB / 8000, "gb": GB, "mb": GB / 1000}[rate.group(2).lower()]
    bytes_per_s = float(rate.group(1)) * scale
    if bytes_per_s <= 0:
        raise SpecError(f"--links {text!r}: the rate must be above 0")
    seconds = float(latency.group(1)) * (1e-3 if latency.group(2).lower() == "ms" else 1e-6)
    return Link(name, bytes_per_s, seconds)


def parse_links(spec: str | None, nodes: tuple[Node, ...]) -> tuple[Link | None, Link]:
    """`INTRA[,INTER]`: the link between devices of one node (None on a CPU host: the measured local
    hop) and between nodes. Without a spec, each device's own link and the default between nodes."""
    cpu = nodes[0].device == CPU
    intra: Link | None = None if cpu else LINKS[CATALOG[nodes[0].device].link]
    inter = LINKS[DEFAULT_INTER_HOST if cpu else DEFAULT_INTER_NODE]
    if spec:
        parts = [p for p in spec.split(",") if p.strip()]
        if len(parts) > 2:
            raise SpecError(f"--links {spec!r}: at most two links, INTRA,INTER")
        if len(parts) == 1 and len(nodes) > 1:  # one link for a multi-node cluster: the one between nodes
            inter = parse_link(parts[0])
        else:
            intra = None if cpu and parts[0].strip().lower() == "local" else parse_link(parts[0])
            if len(parts) == 2:
                inter = parse_link(parts[1])
    return intra, inter
