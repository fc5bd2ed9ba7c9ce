"""Admission and routing limits on a real cluster: a burst past the bound, and no full chain."""

from __future__ import annotations

import asyncio
import time

import pytest

from layerline.client import AsyncClient, Client, InvalidArgument, ResourceExhausted, Unavailable
from layerline.launcher import ClusterPlan, LocalCluster

from .stage_client import free_port

pytestmark = [pytest.mark.real_model, pytest.mark.cluster]


def test_a_burst_past_the_queue_bound_gets_resource_exhausted(real_model_dir, tmp_path, hf_greedy):
    """2 generating + 2 queued are admitted; the other 6 of a burst of 10 are refused at once.
    The prompt and chat bounds given on the command line hold too."""
    plan = ClusterPlan(
        model=str(real_model_dir),
        stages=2,
        port=free_port(),
        log_dir=tmp_path,
        kv_memory="32M",
        coordinator_args=(
            *("--max-active", "2", "--max-queued", "2"),
            *("--max-prompt-bytes", "1K", "--max-prompt-tokens", "12", "--max-chat-messages", "2"),
        ),
    )
    cluster = LocalCluster(plan, real_model_dir)
    cluster.start()
    try:
        cluster.wait_ready(timeout=180)

        async def burst() -> list[object]:
            async with AsyncClient(cluster.address, retries=0) as client:  # refusals as they come, not retried
                calls = [client.generate("Once upon a time", max_tokens=24, temperature=0.0) for _ in range(10)]
                return await asyncio.gather(*calls, return_exceptions=True)

        outcomes = asyncio.run(burst())
        with Client(cluster.address) as client:
            with pytest.raises(InvalidArgument, match="prompt is longer than max_prompt_bytes = 1024 bytes"):
                client.generate("x" * 1025, max_tokens=1)
            with pytest.raises(InvalidArgument, match="prompt is 13 tokens; max_prompt_tokens = 12"):
                client.generate(" ".join(["word"] * 13), max_tokens=1)
            with pytest.raises(InvalidArgument, match="messages: 3 messages; max_chat_messages = 2"):
                client.chat([{"role": "user", "content": "hi"}] * 3, max_tokens=1)
    finally:
        cluster.stop()
    done = [o for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, ResourceExhausted)]
    assert (len(done), len(refused)) == (4, 6), outcomes
    assert all(r.retry_after == 1.0 and "max_queued = 2" in r.details for r in refused)
    expected = hf_greedy("Once upon a time", 24)
    assert all(d.token_ids == expected for d in done)


def test_no_chain_covering_every_layer_is_unavailable(real_model_dir, tmp_path):
    plan = ClusterPlan(
        model=str(real_model_dir), port=free_port(), log_dir=tmp_path, kv_memory="16M", layer_ranges=((0, 15),)
    )
    cluster = LocalCluster(plan, real_model_dir)
    cluster.start()
    try:
        with Client(cluster.address) as client:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    if [w.layers for w in client.cluster(timeout=2).workers] == [(0, 15)]:
                        break
                except Unavailable:
                    pass
                time.sleep(0.2)
            with pytest.raises(Unavailable, match=r"no complete chain of workers covers layers \[0, 30\)"):
                client.generate("hi", max_tokens=4, temperature=0.0)
            assert client.cluster().chains == []
    finally:
        cluster.stop()
    assert all(p.returncode == 0 for _, p in cluster.procs)
