"""Other cluster layouts through the SDK: an uneven 3-stage split, and 2 replicas x 2 stages."""

from __future__ import annotations

import asyncio

import pytest

from layerline.client import AsyncClient, Client
from layerline.launcher import ClusterPlan, LocalCluster

from .stage_client import free_port

pytestmark = [pytest.mark.real_model, pytest.mark.cluster]

PROMPTS = [
    "Hi",
    "Once upon a time",
    "The three primary colors are",
    "def fibonacci(n):",
    "Water boils at",
    "In 1492, Columbus sailed across the Atlantic Ocean and",
    "List three fruits:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
]


def eight_concurrent(address: str) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async with AsyncClient(address) as client:
            done = await asyncio.gather(*(client.generate(p, max_tokens=12, temperature=0.0) for p in PROMPTS))
        return [d.token_ids for d in done]

    return asyncio.run(run())


@pytest.mark.parametrize(
    "layout",
    [
        dict(stages=3, layer_ranges=((0, 7), (7, 20), (20, 30))),
        dict(stages=2, replicas=2),
    ],
    ids=["3-stages-uneven", "2-replicas-x-2-stages"],
)
def test_eight_concurrent_requests_equal_transformers(real_model_dir, tmp_path, hf_greedy, layout):
    plan = ClusterPlan(model=str(real_model_dir), port=free_port(), log_dir=tmp_path, kv_memory="32M", **layout)
    cluster = LocalCluster(plan, real_model_dir)
    cluster.start()
    try:
        status = cluster.wait_ready(timeout=180)
        got = eight_concurrent(cluster.address)
        with Client(cluster.address) as client:
            chains = client.cluster().chains
    finally:
        cluster.stop()
    assert got == [hf_greedy(p, 12) for p in PROMPTS]
    replicas = layout.get("replicas", 1)
    assert len(status.chains) == replicas
    assert all(len(c.addresses) == layout["stages"] for c in chains)
    assert all(p.returncode == 0 for _, p in cluster.procs)
