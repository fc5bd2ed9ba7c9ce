"""`layerline bench routing`: cache-aware routing against load-only, on the same workload.

Runs two clusters of 2 replicas, one after the other, the coordinator of one routing by cache
(`--routing cache`: a new sequence goes to the chain whose live or cached sequences hold the
longest prefix of it) and of the other by load only (`--routing load`). Each serves the same 48
requests, 12 for each of 4 system prompts of about 300 tokens, in the same shuffled order, a few
at a time. It reports, for each, the prefix-cache hit rate (prompt tokens found in the chain's
KV over those looked up, from the coordinator's counters) and the median time to the first
token, as the client sees it.

Knows nothing of the coordinator's internals: it sees the SDK and ClusterStatus.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from layerline.client import AsyncClient
from layerline.launcher import ClusterPlan, LocalCluster

SUBJECTS = ("astronomy", "cooking", "the history of Rome", "Python programming")


def system_prompt(subject: str) -> str:
    """About 300 tokens of instructions for an assistant on `subject`."""
    rules = " ".join(
        f"Rule {i}: when asked about {subject}, answer in plain words, cite what you know, say what you "
        f"do not know, and keep the answer short."
        for i in range(1, 12)
    )
    return f"You are a careful assistant who knows {subject} well. {rules} Now the question: "


@dataclass(frozen=True)
class RoutingFigures:
    routing: str  # "cache" or "load"
    hit_rate: float  # prompt tokens found in the KV / prompt tokens looked up
    median_ttft_s: float
    requests: int


def _workload(seed: int, per_prompt: int) -> list[str]:
    prompts = [f"{system_prompt(s)}question {q} about {s}?" for s in SUBJECTS for q in range(per_prompt)]
    random.Random(seed).shuffle(prompts)
    return prompts


async def _serve(cluster: LocalCluster, prompts: list[str], *, concurrency: int, tokens: int) -> list[float]:
    limit = asyncio.Semaphore(concurrency)
    async with AsyncClient(cluster.address) as client:

        async def one(prompt: str) -> float:
            """Its first token's wait; the answer is read to its end (a request left early is
            cancelled, and its KV never joins the prefix cache)."""
            async with limit:
                start, first = time.perf_counter(), 0.0
                async for chunk in client.stream(prompt, max_tokens=tokens, temperature=0.0):
                    if chunk.token_ids and not first:
                        first = time.perf_counter() - start
                return first

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def measure(
    checkpoint: Path,
    routing: str,
    *,
    port: int,
    log_dir: Path,
    seed: int = 0,
    per_prompt: int = 12,
    concurrency: int = 4,
    tokens: int = 8,
    log: Callable[[str], None] = print,
) -> RoutingFigures:
    """One cluster of 2 replicas routing by `routing`, the workload through it."""
    plan = ClusterPlan(
        model=str(checkpoint),
        stages=1,
        replicas=2,
        port=port,
        log_dir=log_dir / routing,
        coordinator_args=("--routing", routing),
    )
    cluster = LocalCluster(plan, checkpoint)
    cluster.start()
    try:
        cluster.wait_ready()
        prompts = _workload(seed, per_prompt)
        log(f"{routing}: {len(prompts)} requests, {concurrency} at a time")
        with cluster.client() as client:
            before = client.cluster()
            ttfts = asyncio.run(_serve(cluster, prompts, concurrency=concurrency, tokens=tokens))
            after = client.cluster()
    finally:
        cluster.stop()
    queried = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.shared_prefix_tokens - before.shared_prefix_tokens
    return RoutingFigures(routing, hits / max(queried, 1), statistics.median(ttfts), len(prompts))


def table(figures: list[RoutingFigures]) -> str:
    lines = ["| routing | prefix-cache hit rate | median first token | requests |", "| --- | --- | --- | --- |"]
    lines += [
        f"| {f.routing} | {100 * f.hit_rate:.0f}% | {1000 * f.median_ttft_s:.0f} ms | {f.requests} |" for f in figures
    ]
    return "\n".join(lines) + "\n"
