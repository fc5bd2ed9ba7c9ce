"""Where a new sequence goes when there are several chains: cache-aware routing against load-only."""

from __future__ import annotations

import asyncio

from layerline.coordinator.chain import MemberLinks
from layerline.coordinator.cluster import BALANCE_SLACK, Cluster, RunningChain
from layerline.coordinator.registry import Registry
from layerline.coordinator.scheduler import ChainScheduler
from layerline.coordinator.steps import Sequence
from layerline.shared.sampling import SamplingParams

SYSTEM = list(range(100, 400))  # a 300-token system prompt


def seq(name: str, prompt: list[int], *, fed: int = 0) -> Sequence:
    return Sequence(name, prompt, SamplingParams(), on_token=lambda *a: None, on_error=lambda *a: None, fed=fed)


def chains(loads: tuple[int, int], *, cached_on: int) -> list[RunningChain]:
    """Two chains with `loads` live sequences each; the chain `cached_on` keeps a finished request
    with the system prompt in its prefix cache."""
    out = []
    for replica, load in enumerate(loads):
        sched = ChainScheduler(lambda step: None, depth=1, cache_tokens=4096, on_step_failed=print, release=None)  # type: ignore[arg-type]
        for i in range(load):
            sched.add(seq(f"live-{replica}-{i}", [7, replica, i, 9, 9], fed=5))
        if replica == cached_on:
            done = seq("finished", [*SYSTEM, 1, 2, 3], fed=303)
            done.done = done.complete = True
            assert sched.cached.add(done) == []
        out.append(RunningChain(replica, [], None, sched))  # type: ignore[arg-type]
    return out


def route(routing: str, loads: tuple[int, int], prompt: list[int], *, cached_on: int = 1) -> int:
    async def run() -> int:
        cluster = Cluster(
            Registry(num_layers=4), max_message_bytes=1 << 20, token_budget=64, links=MemberLinks(b"k" * 32),
            routing=routing,
        )  # fmt: skip
        cluster.chains = chains(loads, cached_on=cached_on)
        return cluster._route(seq("new", prompt)).replica

    return asyncio.run(run())


def test_a_prompt_goes_to_the_chain_that_holds_its_prefix_unless_that_chain_is_far_busier() -> None:
    asked = [*SYSTEM, 5, 6, 7]
    assert route("cache", (1, 3), asked) == 1  # busier by 2, but it holds 300 of the tokens
    assert route("load", (1, 3), asked) == 0  # load-only: the idler chain, which must compute them all
    assert route("cache", (1, 2 + BALANCE_SLACK), asked) == 0  # too far beyond the least loaded
    assert route("cache", (1, 1 + BALANCE_SLACK), asked) == 1
    assert route("cache", (2, 1), [1, 2, 3, 4, 5, 6]) == 1  # nothing held anywhere: the least loaded
    assert route("cache", (1, 3), asked, cached_on=0) == 0
