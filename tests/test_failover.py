"""Failover with real processes: SIGKILL a stage worker mid-generation; no token is lost."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from layerline.client import AsyncClient, Unavailable
from layerline.launcher import ClusterPlan, LocalCluster

from .stage_client import free_port

pytestmark = pytest.mark.real_model

PROMPTS = [f"Chapter {i + 1}. Once upon a time, in a village by the sea," for i in range(16)]


async def _streams(address: str, n: int, *, on_token=None) -> list[tuple[list[int], str, str]]:  # type: ignore[no-untyped-def]
    async with AsyncClient(address) as client:
        async def one(i: int) -> tuple[list[int], str, str]:
            ids: list[int] = []
            text = ""
            reason = ""
            async for chunk in client.stream(PROMPTS[i], max_tokens=n, temperature=0.0):
                ids += chunk.token_ids
                text += chunk.text
                reason = chunk.finish_reason or reason
                if on_token is not None:
                    on_token(i, len(ids))
            return ids, text, reason

        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))


def test_sigkill_of_a_stage_worker_loses_no_token(real_model_dir, tmp_path):
    plan = ClusterPlan(model=str(real_model_dir), stages=2, replicas=2, port=free_port(), log_dir=tmp_path,
                       kv_memory="32M")
    cluster = LocalCluster(plan, real_model_dir)
    cluster.start()
    try:
        cluster.wait_ready(timeout=180)
        reference = asyncio.run(_streams(cluster.address, 48))
        rng = random.Random(time.time_ns())
        watched = max(range(len(PROMPTS)), key=lambda i: len(reference[i][0]))  # the longest answer
        assert len(reference[watched][0]) >= 16
        kill_after = rng.randrange(2, len(reference[watched][0]) - 8)
        victim_name, victim = rng.choice([(n, p) for n, p in cluster.procs if n.startswith("stage")])
        killed_at: list[float] = []

        def maybe_kill(stream: int, tokens: int) -> None:
            if not killed_at and stream == watched and tokens >= kill_after:
                victim.kill()
                killed_at.append(time.monotonic())

        faulty = asyncio.run(_streams(cluster.address, 48, on_token=maybe_kill))
    finally:
        cluster.stop()
    assert killed_at, "the worker was never killed"
    assert victim.returncode == -9
    # 16 of 16 complete, each identical to the fault-free run: no missing or repeated delta.
    assert [f[0] for f in faulty] == [r[0] for r in reference], (victim_name, kill_after)
    assert [f[1] for f in faulty] == [r[1] for r in reference]
    assert all(f[2] == r[2] for f, r in zip(faulty, reference))
    others = [p.returncode for n, p in cluster.procs if p is not victim]
    assert others == [0] * len(others)


def test_losing_the_only_worker_of_some_layers_ends_with_unavailable(real_model_dir, tmp_path):
    plan = ClusterPlan(model=str(real_model_dir), stages=2, port=free_port(), log_dir=tmp_path, kv_memory="32M")
    cluster = LocalCluster(plan, real_model_dir)
    cluster.start()
    try:
        cluster.wait_ready(timeout=180)
        victim = dict(cluster.procs)["stage-r0-15-30"]

        async def run() -> list[BaseException | tuple]:
            async with AsyncClient(cluster.address) as client:
                async def one(i: int):  # type: ignore[no-untyped-def]
                    async for chunk in client.stream(PROMPTS[i], max_tokens=200, temperature=0.0):
                        if chunk.token_ids and i == 0 and victim.poll() is None:
                            victim.kill()
                    return ()

                return await asyncio.gather(*(one(i) for i in range(4)), return_exceptions=True)

        start = time.monotonic()
        outcomes = asyncio.run(run())
        elapsed = time.monotonic() - start
    finally:
        cluster.stop()
    assert all(isinstance(o, Unavailable) for o in outcomes), outcomes
    assert all("no complete chain of workers covers layers [0, 30)" in o.details for o in outcomes)
    assert elapsed < 40  # within the retry budget (10 s of waiting for a chain), none hangs
