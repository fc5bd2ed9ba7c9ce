"""`layerline bench`: the performance figures of DESIGN.md, measured in one run, as ratios.

Owns the measurement plan. transformers' `generate` is the baseline (single stream, a batch of
32 and the first token of a long prompt, same dtype, same thread count), loaded in this
process; a 1-stage, a 2-stage and a 1-stage tensor-parallel (tp 3) local cluster run beside it
as real processes, measured through the client SDK; the 2-stage one also through its
OpenAI-compatible HTTP API with the official `openai` client (openai_streams.py), a single stream
and 16 at once beside the same through the SDK. Only one thing computes at a time, and the
measurements are interleaved in rounds (baseline, 1 stage, 2 stages, then the other way round
...; rounds.py) with the median of each kept, so that the drift of a shared machine touches both
sides of every ratio alike; the budgeted ratios are also given round by round.
A single stream's time between tokens is also split into its chain's compute, as the stages count
it (asked of each stage after the first token and after the last), and the rest: what a hop adds in
messages and what it adds in slower compute (the hop itself, 2 stages' gap minus 1's, is the median
of the rounds' differences, as the relay's below: `rounds.paired_differences`). Last, `hop_floor`
measures the same extra hop through a bare gRPC relay of the model's matmuls (see hop_floor.py):
what this machine charges for a hop before any of layerline's own work, its lone row on a ring (the
last stage feeds the first, as a lone stream's first stage runs ahead), 2 stages against 1 the
floor under a lone stream's; and the same relays at 32 rows a step, the driver sending each step as
the coordinator sends a batch's: the floor under 32 streams on 2 stages against 1. The clusters,
and how a stream and many are measured, are clusters.py's. Beside transformers' batch of 32, in the
same rounds, `BatchFloor` times the model's matrix products alone at 32 rows (batch_floor.py): the
floor under the 32-stream figures. Beside the single streams, `BandwidthFloor` times this process
reading memory (bandwidth_floor.py): a lone token reads every weight once, so the weights' bytes
over that speed is the floor under the single-stream figure. transformers is needed here only, as
the baseline (baseline.py).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from layerline.bench.bandwidth_floor import BandwidthFloor, screened_weight_bytes
from layerline.bench.baseline import Baseline
from layerline.bench.batch_floor import BatchFloor
from layerline.bench.client_cpu import ClientCpu, http_floor
from layerline.bench.clusters import (
    LONG_PROMPT,
    PROMPT,
    cluster_aggregate,
    cluster_long_ttft,
    cluster_single,
    measured_cluster,
)
from layerline.bench.hop_floor import HopFloor, measure_hop_floor
from layerline.bench.machine import this_machine
from layerline.bench.openai_streams import check_http_is_grpc, http_aggregate, http_single
from layerline.bench.rounds import describe, interleaved, paired, paired_differences
from layerline.bench.stream import Seconds, Stream
from layerline.launcher import ClusterPlan
from layerline.shared.model_config import ModelConfig

BUDGETS = {  # ratio name -> the least it may be (DESIGN.md, performance budgets)
    "single_stream_1_stage_vs_transformers": 1.8,
    "single_stream_2_stages_vs_1_stage": 0.9,
    "concurrent_32_vs_transformers_batch_32": 1.8,
    "concurrent_32_2_stages_vs_1_stage": 0.95,
    # The OpenAI-compatible HTTP API against the gRPC SDK, on the same 2-stage cluster.
    "http_vs_grpc_single_stream": 0.95,
    "http_vs_grpc_16_streams": 0.95,
}
# The budgeted ratios of two figures measured in the same rounds: (singles or aggregates, numerator, denominator).
PAIRS = {
    "single_stream_1_stage_vs_transformers": ("single", "1_stage", "transformers"),
    "single_stream_2_stages_vs_1_stage": ("single", "2_stages", "1_stage"),
    "concurrent_32_vs_transformers_batch_32": ("aggregate", "2_stages_x32", "transformers_batch_32"),
    "concurrent_32_2_stages_vs_1_stage": ("aggregate", "2_stages_x32", "1_stage_x32"),
    "http_vs_grpc_single_stream": ("single", "2_stages_http", "2_stages"),
    "http_vs_grpc_16_streams": ("aggregate", "2_stages_x16_http", "2_stages_x16"),
}
MAX_HOP_VS_RELAY = 1.5  # an extra hop may add at most this many times the bare relay's time
TLS_RATIO = "single_stream_2_stages_tls_vs_plaintext"  # with --tls: TLS everywhere against plaintext
MIN_TLS_RATIO = 0.95


@dataclass
class BenchResult:
    model: str
    dtype: str
    threads: int
    new_tokens: int
    rounds: int
    single_stream: dict[str, Stream] = field(default_factory=dict)  # medians: "transformers", ...
    aggregate_tokens_per_s: dict[str, float] = field(default_factory=dict)  # medians
    long_prompt_ttft_s: dict[str, float] = field(default_factory=dict)  # medians; LONG_PROMPT, one at a time
    long_prompt_tokens: int = 0
    weights_bytes_per_rank: dict[str, int] = field(default_factory=dict)  # largest rank of each cluster
    hop_floor: dict[str, object] = field(default_factory=dict)  # the bare relays' figures (HopFloor), a lone row
    split_floor_32: dict[str, object] = field(default_factory=dict)  # the same relays at 32 rows a step
    bandwidth_floor: dict[str, float] = field(default_factory=dict)  # medians; bandwidth_floor.py
    client_cpu_ms_per_token: dict[str, float] = field(default_factory=dict)  # medians; client_cpu.py
    ratios: dict[str, float] = field(default_factory=dict)  # of the medians
    paired_ratios: dict[str, list[float]] = field(default_factory=dict)  # PAIRS' ratios within each round
    paired_differences_ms: dict[str, list[float]] = field(default_factory=dict)  # the hops' within each round
    within_budget: dict[str, bool] = field(default_factory=dict)
    machine: dict[str, object] = field(default_factory=dict)  # the CPU and the kernels that served (machine.py)


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _median_stream(samples: list[Stream]) -> Stream:
    return Stream(*(statistics.median(getattr(s, f.name) for s in samples) for f in fields(Stream)))


def _rounds(rounds: int, runs: dict[str, Callable[[], object]]) -> dict[str, list]:
    return interleaved(rounds, runs, show=_show, log=_log)


def _show(value: object) -> str:
    if isinstance(value, Stream):
        parts = f"; a token: compute {value.compute_ms:.1f} + other {value.other_ms:.1f} ms" if value.compute_ms else ""
        return f"{value.decode_tokens_per_s:.1f} tok/s (ttft {value.ttft_s * 1000:.0f} ms{parts})"
    if isinstance(value, Seconds):
        return f"{value * 1000:.0f} ms"
    return f"{value:.1f} tok/s"


def _bandwidth_floor(config: ModelConfig, dtype: str, rounds: int) -> dict[str, float]:
    """A lone stream's rate at this process's read bandwidth, once a round (medians)."""
    _log("memory bandwidth (the floor under a single stream) ...")
    import torch

    from layerline.stage_worker.layouts import keeps_head_screen

    floor = BandwidthFloor(config, dtype)
    tokens = statistics.median(_rounds(rounds, {"bandwidth_floor": floor.tokens_per_s})["bandwidth_floor"])
    screened = keeps_head_screen(getattr(torch, dtype)) and config.vocab_size % 32 == 0
    read = screened_weight_bytes(config, dtype) if screened else floor.weight_bytes
    return {
        "weights_bytes_per_token": floor.weight_bytes,
        "read_gb_per_s": tokens * floor.weight_bytes / 1e9,
        "tokens_per_s": tokens,
        # where a greedy step reads the LM head through its int8 screen (head_screen.py): its bytes and rate
        "head_screen": float(screened),
        "screened_bytes_per_token": read,
        "screened_tokens_per_s": tokens * floor.weight_bytes / read,
    }


def run_bench(
    checkpoint: Path,
    *,
    dtype: str = ClusterPlan.dtype,
    new_tokens: int = 64,
    rounds: int = 5,
    port: int = 7179,
    json_path: Path | None = None,
    tls: bool = False,
) -> BenchResult:
    """The figures of DESIGN.md, in one run; with `tls`, also a 2-stage cluster with TLS everywhere
    beside the plaintext one, for the single stream's cost of TLS."""
    threads = os.cpu_count() or 1
    result = BenchResult(model=checkpoint.name, dtype=dtype, threads=threads, new_tokens=new_tokens, rounds=rounds)
    result.machine = this_machine()
    _log(f"on {result.machine['cpu']} ({result.machine['cpus']} CPUs), kernels {result.machine['kernels']}")
    _log(f"loading the transformers baseline ({dtype}, {threads} threads) ...")
    baseline = Baseline(checkpoint, dtype=dtype, threads=threads, prompt=PROMPT, long_prompt=LONG_PROMPT)
    _log("building the model's products at 32 rows (the floor under 32 streams) ...")
    config = ModelConfig.from_checkpoint(checkpoint)
    floor32 = BatchFloor(config, rows=32, dtype=dtype)
    logs = Path(tempfile.gettempdir()) / f"layerline-bench-{os.getpid()}"
    layouts: dict[str, dict[str, Any]] = {
        "1_stage": {"stages": 1},
        "2_stages": {"stages": 2, "http_port": port + 5},  # also the OpenAI-compatible HTTP API
        "1_stage_tp3": {"stages": 1, "tp": 3},
        **({"2_stages_tls": {"stages": 2, "tls": True}} if tls else {}),
    }
    clusters = {
        name: measured_cluster(checkpoint, port=port + i, log_dir=logs / name, dtype=dtype, **layout)
        for i, (name, layout) in enumerate(layouts.items(), start=1)
    }
    try:
        for cluster in clusters.values():
            cluster.start()
        for cluster in clusters.values():
            cluster.wait_ready()
            cluster_aggregate(cluster, 2, 4)  # warm up
        one, two, tp3 = clusters["1_stage"], clusters["2_stages"], clusters["1_stage_tp3"]
        http_aggregate(two, PROMPT, 2, 4)  # warm up
        check_http_is_grpc(two, PROMPT, new_tokens)
        for name, cluster in clusters.items():
            with cluster.client() as client:
                result.weights_bytes_per_rank[name] = max(w.weights_bytes for w in client.cluster().workers)
        _log("single streams ...")
        singles = _rounds(
            rounds,
            {
                "transformers": lambda: baseline.single(new_tokens),
                "1_stage": lambda: cluster_single(one, new_tokens),
                "1_stage_sampled": lambda: cluster_single(one, new_tokens, sampled=True),
                "2_stages": lambda: cluster_single(two, new_tokens),
                "2_stages_http": lambda: http_single(two, PROMPT, new_tokens),
                "1_stage_tp3": lambda: cluster_single(tp3, new_tokens),
                **({"2_stages_tls": lambda: cluster_single(clusters["2_stages_tls"], new_tokens)} if tls else {}),
            },
        )
        result.single_stream = {k: _median_stream(v) for k, v in singles.items()}
        result.bandwidth_floor = _bandwidth_floor(config, dtype, rounds)
        _log("long prompts ...")
        longs = _rounds(
            rounds,
            {
                "transformers": baseline.long_ttft,
                "1_stage": lambda: cluster_long_ttft(one),
                "2_stages": lambda: cluster_long_ttft(two),
            },
        )
        result.long_prompt_ttft_s = {k: statistics.median(v) for k, v in longs.items()}
        result.long_prompt_tokens = int(baseline.long_ids.shape[1])
        _log("concurrent streams ...")
        cpu = ClientCpu()  # the bench's own client: what HTTP's 16 streams pay for the `openai` client
        aggregates = _rounds(
            rounds,
            {
                "transformers_batch_32": lambda: baseline.batch(32, new_tokens),
                "matmul_floor_x32": lambda: floor32.generate(new_tokens),
                "2_stages_x32": lambda: cluster_aggregate(two, 32, new_tokens),
                "1_stage_x32": lambda: cluster_aggregate(one, 32, new_tokens),
                "1_stage_x32_sampled": lambda: cluster_aggregate(one, 32, new_tokens, sampled=True),
                "2_stages_x16": cpu.measured("2_stages_x16", lambda: cluster_aggregate(two, 16, new_tokens)),
                "2_stages_x16_http": cpu.measured(
                    "2_stages_x16_http", lambda: http_aggregate(two, PROMPT, 16, new_tokens)
                ),
            },
        )
        aggregates.update(
            _rounds(
                1,
                {
                    "2_stages_x1": lambda: cluster_aggregate(two, 1, new_tokens),
                    "2_stages_x8": lambda: cluster_aggregate(two, 8, new_tokens),
                },
            )
        )
        result.aggregate_tokens_per_s = {k: statistics.median(v) for k, v in aggregates.items()}
        result.client_cpu_ms_per_token = cpu.medians()
    finally:
        for cluster in clusters.values():
            cluster.stop()
    _log(f"the floors of a split: a bare gRPC relay of the model's matmuls in {dtype} (a lone row, then 32) ...")
    floor, split32 = (
        measure_hop_floor(
            config,
            rounds=rounds,
            tokens=new_tokens,
            port=port + 10,
            ranges=two.ranges,  # split as the 2-stage cluster was
            threads=two.chain_threads,  # as its steps run: one at a time, on the chain's cores
            rows=rows,  # a lone stream's hop, then the 32 streams' steps
            dtype=dtype,
            ring=rows == 1,  # a lone stream's first stage runs ahead from the last stage's tokens; a batch waits
            env=two.stage_env(),  # its threads and OpenMP binding
            log=_log,
        )
        for rows in (1, 32)
    )
    result.hop_floor, result.split_floor_32 = asdict(floor), asdict(split32)
    _judge(result, floor, split32, singles=singles, aggregates=aggregates, tls=tls)
    text = json.dumps(asdict(result), indent=2)
    if json_path is not None:
        json_path.write_text(text + "\n")
    print(text)
    return result


def _judge(
    result: BenchResult,
    floor: HopFloor,
    split32: HopFloor,
    *,
    singles: dict[str, list],
    aggregates: dict[str, list],
    tls: bool,
) -> None:
    """The run's ratios (of medians, and within each round for PAIRS) and whether each is within budget."""
    s = {k: v.decode_tokens_per_s for k, v in result.single_stream.items()}
    a, c = result.aggregate_tokens_per_s, result.client_cpu_ms_per_token
    gaps = {k: [v.median_gap_ms for v in singles[k]] for k in ("1_stage", "2_stages")}
    hops = paired_differences(gaps["2_stages"], gaps["1_stage"])
    result.paired_differences_ms = {
        "added_ms_per_extra_hop_per_token": hops,
        "added_ms_per_extra_hop_per_token_bare_relay": floor.added_ms_per_hop_rounds,
    }
    result.ratios = {
        "single_stream_1_stage_vs_transformers": s["1_stage"] / s["transformers"],
        "single_stream_2_stages_vs_1_stage": s["2_stages"] / s["1_stage"],
        # The floor under it: the bare relays' lone row on a ring (the last stage feeds the first, as
        # a lone stream runs ahead), 2 stages against 1, their rounds taking turns; and ours over it.
        "single_stream_2_stages_vs_1_stage_bare_relay": floor.two_vs_one_stage,
        "single_stream_2_stages_vs_1_stage_vs_bare_relay": s["2_stages"] / s["1_stage"] / floor.two_vs_one_stage,
        "concurrent_32_vs_transformers_batch_32": a["2_stages_x32"] / a["transformers_batch_32"],
        "concurrent_32_1_stage_vs_transformers_batch_32": a["1_stage_x32"] / a["transformers_batch_32"],
        # What drawing costs beside greedy's argmax (temperature 0.8, top-p 0.95): on 1 stage, alone and 32 at once.
        "single_stream_sampled_vs_greedy_1_stage": s["1_stage_sampled"] / s["1_stage"],
        "concurrent_32_sampled_vs_greedy_1_stage": a["1_stage_x32_sampled"] / a["1_stage_x32"],
        "concurrent_32_2_stages_vs_1_stage": a["2_stages_x32"] / a["1_stage_x32"],
        # The floor under it: the bare relays at 32 rows a step, split the same way (hop_floor.py),
        # 2 stages against 1 (their rounds take turns every few steps); and ours against it.
        "concurrent_32_2_stages_vs_1_stage_bare_relay": split32.two_vs_one_stage,
        "concurrent_32_2_stages_vs_1_stage_vs_bare_relay": a["2_stages_x32"]
        / a["1_stage_x32"]
        / split32.two_vs_one_stage,
        # The floor under the 32-stream ratios: 32 rows through the model's products and nothing
        # else (batch_floor.py), against transformers' batch (the most an engine of torch's
        # products could show) and against one stage's 32 streams (how much of it layerline keeps).
        "matmul_floor_32_vs_transformers_batch_32": a["matmul_floor_x32"] / a["transformers_batch_32"],
        "concurrent_32_1_stage_vs_matmul_floor": a["1_stage_x32"] / a["matmul_floor_x32"],
        # The floor under the first ratio: the bare relay's one stage (the model's matmuls on a
        # stage's packed weights at the run's dtype, its steps going on from its own tokens)
        # against ours, and against transformers: what those products alone show over it here.
        "single_stream_1_stage_vs_bare_relay": floor.one_stage_gap_ms / result.single_stream["1_stage"].median_gap_ms,
        "single_stream_bare_relay_vs_transformers": result.single_stream["transformers"].median_gap_ms
        / floor.one_stage_gap_ms,
        # The floor under the first ratio in every dtype: a token's weights read once at this
        # process's read bandwidth (bandwidth_floor.py), against transformers and against ours.
        "single_stream_bandwidth_floor_vs_transformers": result.bandwidth_floor["tokens_per_s"] / s["transformers"],
        "single_stream_1_stage_vs_bandwidth_floor": s["1_stage"] / result.bandwidth_floor["tokens_per_s"],
        # The same where the bench's greedy steps read the LM head through its int8 screen (equal where they do not).
        "single_stream_screened_floor_vs_transformers": result.bandwidth_floor["screened_tokens_per_s"]
        / s["transformers"],
        "single_stream_1_stage_vs_screened_floor": s["1_stage"] / result.bandwidth_floor["screened_tokens_per_s"],
        # The median gap between tokens, 2 stages minus 1: one more hop, the same layers. The median
        # of the rounds' differences (each round streams through both, one after the other), as the
        # bare relay's below.
        "added_ms_per_extra_hop_per_token": statistics.median(hops),
        # Its two parts (of the mean gaps): the two stages' compute over the one stage's, and the
        # rest over the rest (the hop's messages: encoding, the write, the wake-up, decoding).
        "added_ms_per_extra_hop_per_token_compute": (
            result.single_stream["2_stages"].compute_ms - result.single_stream["1_stage"].compute_ms
        ),
        "added_ms_per_extra_hop_per_token_messages": (
            result.single_stream["2_stages"].other_ms - result.single_stream["1_stage"].other_ms
        ),
        # The same difference through the bare relay: this machine's part of the figure above.
        "added_ms_per_extra_hop_per_token_bare_relay": floor.added_ms_per_hop,
        "single_stream_tp3_vs_tp1": s["1_stage_tp3"] / s["1_stage"],
        "http_vs_grpc_single_stream": s["2_stages_http"] / s["2_stages"],
        "http_vs_grpc_16_streams": a["2_stages_x16_http"] / a["2_stages_x16"],
        # What the `openai` client's extra CPU leaves of it on these cores, and the ratio against that.
        "http_vs_grpc_16_streams_client_floor": http_floor(
            c["2_stages_x16"], c["2_stages_x16_http"], a["2_stages_x16"]
        ),
        # transformers' time to the first token of the long prompt over ours: above 1, ours is sooner
        "long_prompt_ttft_1_stage_vs_transformers": result.long_prompt_ttft_s["transformers"]
        / result.long_prompt_ttft_s["1_stage"],
        "long_prompt_ttft_2_stages_vs_transformers": result.long_prompt_ttft_s["transformers"]
        / result.long_prompt_ttft_s["2_stages"],
    }
    result.ratios["http_vs_grpc_16_streams_vs_client_floor"] = (
        result.ratios["http_vs_grpc_16_streams"] / result.ratios["http_vs_grpc_16_streams_client_floor"]
    )
    samples = {"single": {k: [v.decode_tokens_per_s for v in vs] for k, vs in singles.items()}, "aggregate": aggregates}
    result.paired_ratios = {
        name: paired(samples[kind][num], samples[kind][den]) for name, (kind, num, den) in PAIRS.items()
    }
    if tls:
        result.ratios[TLS_RATIO] = s["2_stages_tls"] / s["2_stages"]
        result.paired_ratios[TLS_RATIO] = paired(samples["single"]["2_stages_tls"], samples["single"]["2_stages"])
    for name, within in result.paired_ratios.items():
        _log(f"{name}, round by round: {describe(within)}")
    budgets = {**BUDGETS, TLS_RATIO: MIN_TLS_RATIO} if tls else BUDGETS
    result.within_budget = {k: result.ratios[k] >= least for k, least in budgets.items()}
    result.within_budget["added_ms_per_extra_hop_per_token"] = (
        result.ratios["added_ms_per_extra_hop_per_token"]
        <= MAX_HOP_VS_RELAY * result.ratios["added_ms_per_extra_hop_per_token_bare_relay"]
    )
