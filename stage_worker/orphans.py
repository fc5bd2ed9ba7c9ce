"""The KV that coordinators left behind on a stage, and freeing it.

A sequence's KV lives on a stage until a coordinator releases it. A coordinator that crashed
never will, so a stage frees such KV in two ways:
- at registration, when the coordinator did not know this stage: the sequences held before it
  registered are none of its own (`free_unknown`);
- by age, whatever coordinator there is: a sequence that no step has touched (named it, or copied
  a prefix from it) for `ttl` seconds (`--orphan-ttl`) is freed by a sweep every
  `min(ttl / 4, 5 s)` (`sweep_forever`). A live coordinator steps each sequence it generates
  for every few seconds at most, so what ages out is KV it forgot, or a prefix it caches that no
  request copied for that long (it is told the TTL in `WorkerInfo`). The probe's scratch
  sequence is never freed here.

Everything the engine owns is read and freed on the compute thread, so the sweeps run there, in
order with the steps. Knows nothing of gRPC, of the coordinator's address or of the schedule.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

from .engine import StageEngine
from .ranks import RankFailed
from .step_telemetry import StageTelemetry

log = logging.getLogger("layerline.stage")
T = TypeVar("T")

MAX_SWEEP_SECONDS = 5.0  # the longest wait between two sweeps, whatever the TTL


class OnComputeThread(Protocol):
    def __call__(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run `fn` on the stage's compute thread, after everything submitted before it."""


def free_untouched(engine: StageEngine, ttl: float) -> list[str]:
    """On the compute thread: free the sequences no step touched for longer than `ttl` seconds;
    the ids freed. (Through a tensor-parallel rank 0, each release reaches every rank.)"""
    return [sid for sid in engine.untouched(ttl) if engine.release(sid)]


class Orphans:
    """Frees what coordinators left on this stage: on registering with a stranger, and by age."""

    def __init__(
        self,
        engine: StageEngine,
        *,
        on_compute_thread: OnComputeThread,
        ttl: float,
        telemetry: StageTelemetry,
    ) -> None:
        self.engine = engine
        self.on_compute_thread = on_compute_thread
        self.ttl = ttl  # seconds; 0: never by age
        self.telemetry = telemetry

    @property
    def sweep_seconds(self) -> float:
        """The wait between two sweeps: a sequence is freed at most this long after its TTL."""
        return min(self.ttl / 4, MAX_SWEEP_SECONDS)

    async def held(self) -> list[str]:
        """The sequences held now, but for a probe's scratch one."""
        held = await self.on_compute_thread(self.engine.cache.sequences)
        return [sid for sid in held if not sid.startswith("\x00")]

    async def free_unknown(self, held: list[str]) -> int:
        """Free `held` (taken before registering): the coordinator did not know this stage, so none is its own."""
        engine = self.engine
        freed = await self.on_compute_thread(lambda: sum(engine.release(s) for s in held))
        log.warning("coordinator did not know this worker: freed %d sequence(s) it no longer routes to", freed)
        self.telemetry.orphans(freed, reason="unknown")
        return freed

    async def sweep(self) -> int:
        """Free the sequences no step touched for longer than the TTL; how many."""
        engine, ttl = self.engine, self.ttl
        freed = await self.on_compute_thread(lambda: free_untouched(engine, ttl))
        if freed:
            log.warning(
                "freed %d sequence(s) that no step touched for %gs (--orphan-ttl): "
                "the coordinator that held them is gone or forgot them",
                len(freed),
                ttl,
            )
            self.telemetry.orphans(len(freed), reason="ttl")
        return len(freed)

    async def sweep_forever(self) -> None:
        """Sweep every `sweep_seconds` until cancelled, or until a tensor-parallel rank fails (the
        stage then fails stop); nothing when the TTL is 0 (never)."""
        if not self.ttl:
            return
        while True:
            await asyncio.sleep(self.sweep_seconds)
            try:
                await self.sweep()
            except RankFailed as err:
                log.error("sweeps for orphaned KV stop: %s", err)
                return
