"""layerline's own path on this machine, for `layerline plan --calibrate`: single streams through
1- and 2-stage local clusters of the embedded model, whose stages report their compute, and what
the profile's rates predict for the same streams.

Owns those measurements and that prediction; `calibrate.py` turns them into a step's overhead, the
factor by which a cluster's stages compute slower than steps back to back, and a hop's cost.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from layerline.shared.model_config import ModelConfig

from .profile import MachineProfile

PATH_TOKENS = 32  # tokens of each single stream through the path's clusters


@dataclass(frozen=True)
class PathFigures:
    """Single streams through 1- and 2-stage local clusters of the embedded model, per token."""

    other_s: dict[int, float]  # stages -> the time besides its stages' compute (their own count)
    compute_s: dict[int, float]  # stages -> the stages' compute
    ranges: tuple[tuple[int, int], ...]  # the 2-stage chain's layers


def measure_path(checkpoint: Path, *, port: int, tokens: int, rounds: int, log: Callable[[str], None]) -> PathFigures:
    """Layerline's own path on this machine: single streams of `tokens` through 1 and 2 stages,
    interleaved rounds, medians."""
    from layerline.bench.clusters import cluster_aggregate, cluster_single, measured_cluster

    logs = Path(tempfile.mkdtemp(prefix="layerline-calibrate-"))
    others: dict[int, list[float]] = {1: [], 2: []}
    computes: dict[int, list[float]] = {1: [], 2: []}
    clusters = {
        stages: measured_cluster(checkpoint, port=port + stages, log_dir=logs / f"{stages}", stages=stages)
        for stages in (1, 2)
    }
    try:
        for cluster in clusters.values():
            cluster.start()
        for cluster in clusters.values():
            cluster.wait_ready()
            cluster_aggregate(cluster, 1, 4)  # warm up
        for r in range(rounds):
            for stages, cluster in clusters.items():
                stream = cluster_single(cluster, tokens)
                others[stages].append(stream.other_ms / 1000.0)
                computes[stages].append(stream.compute_ms / 1000.0)
            log(
                f"path round {r + 1}/{rounds}: a token's compute and the rest, 1 stage "
                f"{computes[1][-1] * 1e3:.2f} + {others[1][-1] * 1e3:.2f} ms, 2 stages "
                f"{computes[2][-1] * 1e3:.2f} + {others[2][-1] * 1e3:.2f} ms"
            )
    finally:
        for cluster in clusters.values():
            cluster.stop()
    return PathFigures(
        other_s={k: statistics.median(v) for k, v in others.items()},
        compute_s={k: statistics.median(v) for k, v in computes.items()},
        ranges=tuple((start, end) for start, end in clusters[2].ranges),
    )


def predicted_compute(
    checkpoint: Path, profile: MachineProfile, layers: tuple[tuple[int, int], ...], *, tokens: int
) -> float:
    """Seconds of compute a token of one stream takes through a chain of `layers` of the model at
    `checkpoint`, as `profile` predicts it (the bench's prompt and `tokens` more, as `measure_path`
    times them)."""
    from layerline.bench.clusters import PROMPT

    from .check import count_tokens
    from .hardware import CPU, DEFAULT_INTER_HOST, LINKS
    from .predict import CostModel, Layout, Machine, Workload

    config = ModelConfig.from_checkpoint(checkpoint)
    layout = Layout(1, len(layers), 1, layers)
    machine = Machine(CPU, 1, 1, None, LINKS[DEFAULT_INTER_HOST], profile)
    context = count_tokens(checkpoint, PROMPT) + tokens // 2  # a token's context, on average
    cost = CostModel(config, machine, Workload("float32", context, 1, context), layout)
    return sum(cost.stage(stage, 1, context=context, alone=True) for stage in layout.stages(config.num_layers))
