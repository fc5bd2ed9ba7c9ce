"""Where a stage's torch work runs: one compute thread, for everything.

Owns the stage's single compute thread. Loading the weights, the readiness probe, every step and
every release run on it, in submission order, so that the next step is received and the previous
one sent while this one computes.

One thread, not the event loop for small steps and a thread for the rest: torch's CPU kernels
run on OpenMP, and every thread that enters a parallel region gets an OpenMP team of its own that
lives as long as the thread. libgomp counts the threads of every team, and once they outnumber
the cores it lets an idle thread spin only 100 times (1000 under OMP_WAIT_POLICY=ACTIVE) before
it sleeps, so between two of a step's parallel regions (a single row's step has about 150) the
helpers sleep and are woken again. Measured on 2 cores of an Intel Xeon (AVX-512, AMX), SmolLM2
in one process, a lone stream's decode step on two threads: 26.6 ms with one team, 39-42 ms once
a second thread of the process had run one parallel product, with or without the active policy;
a 1-stage cluster whose small steps ran on its event loop and its larger ones (and its loading)
on other threads computed 39-40 ms a token.

Running a step frees the sequences its header releases, then runs it on the engine, inside the
step's telemetry. Knows nothing of frames, of gRPC or of where the result goes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from .engine import StageEngine, StepOutput
from .frames import ReceivedStep

T = TypeVar("T")


def compute_thread() -> ThreadPoolExecutor:
    """The one thread a stage runs torch on: make it before loading, and load on it."""
    return ThreadPoolExecutor(1, thread_name_prefix="stage-compute")


class StageCompute:
    """The compute thread of a stage's engine."""

    def __init__(self, engine: StageEngine, *, executor: ThreadPoolExecutor | None = None) -> None:
        self.engine = engine
        self.executor = executor or compute_thread()

    def on_thread(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run `fn` on the compute thread, after everything submitted before it."""
        return asyncio.get_running_loop().run_in_executor(self.executor, fn)

    def start(self, step: ReceivedStep, *, chain: str = "") -> asyncio.Future[StepOutput]:
        """Begin computing a step that came by `chain`, after those before it. Failures come in the future."""
        return self.on_thread(lambda: self._run(step, chain))

    def _run(self, step: ReceivedStep, chain: str) -> StepOutput:
        with step.times.computing():
            for sid in step.header.release_sequence_ids:
                self.engine.release(sid)
            return self.engine.run(step.seqs, step.hidden, alone=step.header.alone, chain=chain)

    def shutdown(self, *, wait: bool) -> None:
        """Stop the compute thread (after what it runs now, if `wait`)."""
        self.executor.shutdown(wait=wait)
