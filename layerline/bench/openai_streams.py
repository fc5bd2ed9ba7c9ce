"""`layerline bench`'s figures through the coordinator's OpenAI-compatible HTTP API, sent with the
official `openai` client as its users send them: one streamed completion's time to the first
token and decode rate, the aggregate tokens/s of concurrent streamed completions, and the check
that a greedy answer through HTTP is the gRPC SDK's, text for text.

A streamed chunk carries text, not token ids: the tokens are counted by the stream's usage
(`include_usage`), and the decode rate is the tokens after the first over the time from the
first chunk with text to the last, as clusters.py's gRPC figure is the tokens after the first over
the time from the first message with tokens to the last. The chunks' times are measured as
they come out of the client, so its parsing is part of the figure, as the SDK's is of gRPC's.
Measures only: run.py interleaves these with the gRPC figures in its rounds.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from typing import Any

import openai

from layerline.launcher import LocalCluster

from .stream import Stream


def _base_url(cluster: LocalCluster) -> str:
    if cluster.http_url is None:
        raise RuntimeError("the cluster serves no HTTP API: start it with ClusterPlan(http_port=...)")
    return cluster.http_url


def _api_key(cluster: LocalCluster) -> str:
    return cluster.token or "none"  # the client insists on a key; a cluster without tokens ignores it


def _greedy_stream(prompt: str, n: int) -> dict[str, Any]:
    """A greedy streamed completion of `n` tokens whose last chunk carries the usage."""
    return {
        "model": "",
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def http_single(cluster: LocalCluster, prompt: str, n: int) -> Stream:
    """One greedy streamed completion of `n` tokens, timed as `run.cluster_single` times gRPC's."""
    with openai.OpenAI(base_url=_base_url(cluster), api_key=_api_key(cluster), max_retries=0) as client:
        # Connected, and the client's first stream read, before anything is timed: a new client
        # takes ~40 ms longer over its first chunk, which would shift the first token's time.
        client.completions.create(model="", prompt=prompt, max_tokens=1, temperature=0, stream=True).close()
        start = time.perf_counter()
        arrivals: list[float] = []  # one per chunk with text
        tokens = 0
        chunks = client.completions.create(**_greedy_stream(prompt, n))
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].text:
                arrivals.append(time.perf_counter())
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
    if tokens < 2 or not arrivals:
        raise RuntimeError(f"the stream through HTTP came back with {tokens} tokens in {len(arrivals)} chunks of text")
    first, last = arrivals[0], arrivals[-1]
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    mean_gap = (last - first) / max(tokens - 1, 1)
    return Stream(first - start, 1 / max(mean_gap, 1e-9), 1000 * statistics.median(gaps or [mean_gap]))


def http_aggregate(cluster: LocalCluster, prompt: str, streams: int, n: int) -> float:
    """Tokens/s of `streams` greedy streamed completions at once, timed as `run.cluster_aggregate`."""

    async def one(client: openai.AsyncOpenAI) -> int:
        chunks = await client.completions.create(**_greedy_stream(prompt, n))
        tokens = 0
        async for chunk in chunks:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens

    async def run() -> float:
        async with openai.AsyncOpenAI(base_url=_base_url(cluster), api_key=_api_key(cluster), max_retries=0) as client:
            start = time.perf_counter()
            done = await asyncio.gather(*(one(client) for _ in range(streams)))
            return sum(done) / (time.perf_counter() - start)

    return asyncio.run(run())


def check_http_is_grpc(cluster: LocalCluster, prompt: str, n: int) -> None:
    """RuntimeError unless the greedy streamed answer through HTTP is the gRPC SDK's."""
    with cluster.client() as sdk:
        want = sdk.generate(prompt, max_tokens=n, temperature=0.0).text
    with openai.OpenAI(base_url=_base_url(cluster), api_key=_api_key(cluster), max_retries=0) as client:
        chunks = client.completions.create(model="", prompt=prompt, max_tokens=n, temperature=0, stream=True)
        got = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    if got != want:
        raise RuntimeError(f"the greedy answer through HTTP differs from the gRPC SDK's: {got!r} against {want!r}")
