"""`layerline plan --check`: the planner's predictions for this machine beside local clusters measured
in the same run.

Owns the comparison. It starts real local clusters of the embedded model (1, 2 and 3 stages,
2 replicas of 1 stage, and 1 stage at tp 3), as `layerline bench` does, and measures each one's
single-stream decode tokens/s, aggregate tokens/s of `concurrency` streams and first token of a
prompt of about 300 tokens, in interleaved rounds (medians kept), and, as root, a 2-stage chain
across 1 ms and 5 ms links between two test hosts (check_links.py). It predicts the same figures
from the machine's profile. A figure is within tolerance when it is within 25% of the measurement.
The aggregate prediction is of the same thing the measurement times: the streams' prompts, then
their tokens.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from layerline.bench.clusters import LONG_PROMPT, PROMPT, cluster_aggregate, cluster_long_ttft, cluster_single
from layerline.launcher import ClusterPlan, LocalCluster
from layerline.shared.model_config import ModelConfig

from . import check_links
from .hardware import CPU, DEFAULT_INTER_HOST, LINKS
from .predict import Layout, Machine
from .profile import MachineProfile
from .recommend import layouts

TOLERANCE = 0.25
CHECKED = {  # name -> (tp, pp, dp)
    "1 stage": (1, 1, 1),
    "2 stages": (1, 2, 1),
    "3 stages": (1, 3, 1),
    "2 replicas": (1, 1, 2),
    "tp 3": (3, 1, 1),
}
FIGURES = ("decode_tok_s", "aggregate_tok_s", "ttft_ms")


@dataclass
class Row:
    layout: str
    figure: str
    predicted: float
    measured: float

    @property
    def ratio(self) -> float:
        return self.measured / self.predicted

    @property
    def within(self) -> bool:
        return abs(self.predicted - self.measured) <= TOLERANCE * self.measured


def count_tokens(checkpoint: Path, text: str) -> int:
    """Tokens of `text` under the checkpoint's tokenizer."""
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(text).ids)


def predictions(
    config: ModelConfig, profile: MachineProfile, checkpoint: Path, *, new_tokens: int, concurrency: int, dtype: str
) -> dict[str, dict[str, float]]:
    machine = Machine(CPU, 1, 1, None, LINKS[DEFAULT_INTER_HOST], profile)  # one host: no link between hosts
    short, long = count_tokens(checkpoint, PROMPT), count_tokens(checkpoint, LONG_PROMPT)
    by_shape = {(lay.tp, lay.pp, lay.dp): lay for lay in layouts(config, machine)}
    out = {}
    for name, shape in CHECKED.items():
        layout: Layout = by_shape[shape]
        out[name] = check_links.figures(
            config,
            layout,
            machine,
            short=short,
            long=long,
            new_tokens=new_tokens,
            concurrency=concurrency,
            dtype=dtype,
        )
    return out


def measure(
    checkpoint: Path,
    *,
    dtype: str,
    new_tokens: int,
    concurrency: int,
    rounds: int,
    port: int,
    log: Callable[[str], None],
) -> dict[str, dict[str, float]]:
    logs = Path(tempfile.mkdtemp(prefix="layerline-plan-check-"))
    clusters = {
        name: LocalCluster(
            ClusterPlan(
                model=str(checkpoint),
                stages=pp,
                split="weights",  # the layers where the prediction put them (recommend.py)
                replicas=dp,
                tp=tp,
                dtype=dtype,
                port=port + i,
                log_dir=logs / name.replace(" ", "-"),
                coordinator_args=("--prefix-cache", "0"),  # every round computes its prompt
                stage_args=("--tp-timeout", "60"),  # tp ranks start slowly on a busy machine
            ),
            checkpoint,
        )
        for i, (name, (tp, pp, dp)) in enumerate(CHECKED.items())
    }
    samples: dict[str, dict[str, list[float]]] = {name: {f: [] for f in FIGURES} for name in clusters}
    try:
        for cluster in clusters.values():  # one at a time: loading all at once starves a busy machine
            cluster.start()
            cluster.wait_ready()
            cluster_aggregate(cluster, 2, 4)  # warm up
        for r in range(rounds):
            for name, cluster in clusters.items():
                s = samples[name]
                s["decode_tok_s"].append(cluster_single(cluster, new_tokens).decode_tokens_per_s)
                s["aggregate_tok_s"].append(cluster_aggregate(cluster, concurrency, new_tokens))
                s["ttft_ms"].append(1000 * cluster_long_ttft(cluster))
                log(
                    f"round {r + 1}/{rounds} {name}: {s['decode_tok_s'][-1]:.1f} tok/s alone, "
                    f"{s['aggregate_tok_s'][-1]:.1f} in all, first token {s['ttft_ms'][-1]:.0f} ms"
                )
    finally:
        for cluster in clusters.values():
            cluster.stop()
    return {name: {f: statistics.median(v) for f, v in s.items()} for name, s in samples.items()}


def run_check(
    checkpoint: Path,
    profile: MachineProfile,
    *,
    dtype: str = "float32",
    new_tokens: int = 48,
    concurrency: int = 8,
    rounds: int = 3,
    port: int = 7620,
    links: bool = True,
    log: Callable[[str], None] = print,
) -> list[Row]:
    """Predictions beside measurements for the local layouts and, with `links` where this machine
    can make test hosts (root), for 2 stages across 1 ms and 5 ms links (check_links.py)."""
    config = ModelConfig.from_checkpoint(checkpoint)
    predicted = predictions(config, profile, checkpoint, new_tokens=new_tokens, concurrency=concurrency, dtype=dtype)
    measured = measure(
        checkpoint, dtype=dtype, new_tokens=new_tokens, concurrency=concurrency, rounds=rounds, port=port, log=log
    )
    rows = [Row(name, f, predicted[name][f], measured[name][f]) for name in CHECKED for f in FIGURES]
    if not links:
        return rows
    short, long = count_tokens(checkpoint, PROMPT), count_tokens(checkpoint, LONG_PROMPT)
    across = check_links.link_predictions(
        config, profile, short=short, long=long, new_tokens=new_tokens, concurrency=concurrency, dtype=dtype
    )
    lab = check_links.measure_links(
        checkpoint,
        check_links.split(config, profile),
        dtype=dtype,
        new_tokens=new_tokens,
        concurrency=concurrency,
        rounds=rounds,
        log=log,
    )
    if isinstance(lab, str):
        log(f"2 stages across 1 ms and 5 ms links: not measured here, {lab}")
        return rows
    return rows + [Row(name, f, across[name][f], lab[name][f]) for name in check_links.DELAYS_MS for f in FIGURES]


def check_table(rows: list[Row], *, concurrency: int) -> str:
    names = {
        "decode_tok_s": "decode tok/s, 1 stream",
        "aggregate_tok_s": f"aggregate tok/s, {concurrency} streams",
        "ttft_ms": "first token ms, long prompt",
    }
    lines = [
        "| layout | figure | predicted | measured | measured / predicted | within 25% |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.layout} | {names[r.figure]} | {r.predicted:.1f} | {r.measured:.1f} | {r.ratio:.2f} | "
            f"{'yes' if r.within else 'no'} |"
        )
    return "\n".join(lines) + "\n"
