"""The clusters `layerline bench` (and `layerline plan --check`) measures, and how it measures them.

Owns the prompts, `measured_cluster` (a local cluster laid out as asked, set for measuring), and
the three measurements through the client SDK: a single stream (its tokens a second, the gap
between tokens and that gap split into the stages' compute and the rest, `cluster_single`), the
tokens a second of many streams at once (`cluster_aggregate`) and the first token of a long
prompt (`cluster_long_ttft`).
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from pathlib import Path
from typing import Any

import grpc

from layerline.bench.stream import Seconds, Stream
from layerline.client import AsyncClient, Client, RequestOptions
from layerline.launcher import ClusterPlan, LocalCluster
from layerline.protos.v1 import stage_pb2, stage_pb2_grpc

PROMPT = "Write a long story about a dragon who learns to paint. Once upon a time"
# About 300 tokens, for the time to the first token of a long prompt (prefill, not decoding).
LONG_PROMPT = " ".join(
    f"Rule {i}: answer briefly, mention the price of bread number {i} when asked, and stay polite." for i in range(14)
)


def asked(n: int, *, sampled: bool = False, seed: int = 0) -> RequestOptions:
    """A stream's options: `n` tokens, greedy, or `sampled` at chat clients' common settings
    (temperature 0.8, top-p 0.95) with `seed`, so that each round draws what the last one drew."""
    if sampled:
        return RequestOptions(max_tokens=n, temperature=0.8, top_p=0.95, seed=seed)
    return RequestOptions(max_tokens=n, temperature=0.0)


def measured_cluster(
    checkpoint: Path, *, port: int, log_dir: Path, dtype: str = ClusterPlan.dtype, **layout: Any
) -> LocalCluster:
    """A local cluster of `checkpoint` laid out as `layout` (stages, tp, ...), as the bench measures one.

    Every round sends the same prompt: without the cache of finished requests' KV, each round's
    first token is computed, as transformers computes it (live sharing stays on). Its workers are
    probed when they join and not again within the hour: the clusters of a run idle side by side
    while one is measured, and their readiness probes (a real forward each 15 s; about 0.2 s of
    both cores for the tp-3 stage on 2 cores) would land in its rounds."""
    coordinator = ("--prefix-cache", "0", "--probe-interval", "3600")
    plan = ClusterPlan(
        model=str(checkpoint), dtype=dtype, port=port, log_dir=log_dir, coordinator_args=coordinator, **layout
    )
    return LocalCluster(plan, checkpoint)


def cluster_long_ttft(cluster: LocalCluster) -> Seconds:
    with cluster.client() as client:
        start = time.perf_counter()
        client.generate(LONG_PROMPT, max_tokens=1, temperature=0.0)
        return Seconds(time.perf_counter() - start)


class StageClocks:
    """Asks each stage of a one-chain cluster how many steps it computed so far, and for how long."""

    def __init__(self, cluster: LocalCluster, client: Client) -> None:
        if cluster.certs is None:
            self._channels = [grpc.insecure_channel(w.address) for w in client.cluster().workers]
        else:  # the stages answer members only: ask as the coordinator
            member = cluster.certs.tls_files("coordinator").channel_credentials()
            self._channels = [grpc.secure_channel(w.address, member) for w in client.cluster().workers]
        self._stubs = [stage_pb2_grpc.StageWorkerStub(c) for c in self._channels]
        self.read()  # connected before anything is timed

    def read(self) -> list[tuple[int, float]]:
        infos = (stub.Info(stage_pb2.InfoRequest(), timeout=10).worker for stub in self._stubs)
        return [(w.steps_computed, w.compute_seconds) for w in infos]

    def close(self) -> None:
        for channel in self._channels:
            channel.close()


def cluster_single(cluster: LocalCluster, n: int, *, sampled: bool = False) -> Stream:
    """A lone stream of `n` tokens (`asked`)."""
    with cluster.client() as client:
        clocks = StageClocks(cluster, client)
        try:
            start = time.perf_counter()
            arrivals: list[float] = []
            before: list[tuple[int, float]] = []
            for chunk in client.stream(PROMPT, **asked(n, sampled=sampled, seed=1)):
                arrivals += [time.perf_counter()] * len(chunk.token_ids)
                before = before or clocks.read()  # after the prompt's step: decode steps only from here
            after = clocks.read()
        finally:
            clocks.close()
    first, last = arrivals[0], arrivals[-1]
    gaps = [b - a for a, b in itertools.pairwise(arrivals) if b > a]  # tokens of one message: one gap
    mean_gap = (last - first) / max(len(arrivals) - 1, 1)
    # A step advances this one sequence by a token: per stage, its mean compute per step.
    compute = sum((s1 - s0) / (n1 - n0) for (n0, s0), (n1, s1) in zip(before, after) if n1 > n0)
    return Stream(
        first - start,
        1 / max(mean_gap, 1e-9),
        1000 * statistics.median(gaps),
        1000 * compute,
        1000 * (mean_gap - compute),
    )


def cluster_aggregate(cluster: LocalCluster, streams: int, n: int, *, sampled: bool = False) -> float:
    """Tokens a second of `streams` streams of `n` tokens at once (`asked`, a seed each)."""

    async def run() -> float:
        async with AsyncClient(cluster.address, token=cluster.token, ca_cert=cluster.ca_cert) as client:
            start = time.perf_counter()
            done = await asyncio.gather(
                *(client.generate(PROMPT, **asked(n, sampled=sampled, seed=i)) for i in range(streams))
            )
            return sum(len(d.token_ids) for d in done) / (time.perf_counter() - start)

    return asyncio.run(run())
