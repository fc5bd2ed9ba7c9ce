"""Where a stage's steps compute: its one compute thread, or the event loop for a small step alone.

Owns the stage's single compute thread, on which torch runs in submission order (so the next
step is received and the previous one sent while this one computes), and the rule for the one
exception: a step of at most `SMALL_STEP_TOKENS` tokens runs on the event loop itself when
inline steps are allowed, nothing is queued on the compute thread and it is the only step in
flight on the stage. Two thread handoffs cost more than such a step, and with no other step in
flight the loop has no answer to relay meanwhile. A tensor-parallel rank 0 (`LeadingEngine`)
never runs inline: its thread is shared with the keepalive collective.

Running a step frees the sequences its header releases, then runs it on the engine, inside the
step's telemetry. Knows nothing of frames, of gRPC or of where the result goes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from .engine import StageEngine, StepOutput
from .frames import ReceivedStep
from .ranks import LeadingEngine

SMALL_STEP_TOKENS = 4  # a step of at most this many tokens, alone on the stage, may run inline
T = TypeVar("T")


class StageCompute:
    """The compute thread of a stage's engine, and the choice of where each step runs."""

    def __init__(self, engine: StageEngine) -> None:
        self.engine = engine
        self.inline_small_steps = not isinstance(engine, LeadingEngine)  # rank 0 shares its thread with keepalives
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="stage-compute")
        self.queued = 0  # calls submitted to the compute thread and not yet finished

    def on_thread(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run `fn` on the compute thread, after everything submitted before it."""
        self.queued += 1
        future = asyncio.get_running_loop().run_in_executor(self.executor, fn)
        future.add_done_callback(self._computed)
        return future

    def _computed(self, _: asyncio.Future[Any]) -> None:
        self.queued -= 1

    def start(self, step: ReceivedStep, *, in_flight: int, chain: str = "") -> asyncio.Future[StepOutput]:
        """Begin computing a step that came by `chain`: inline if it is small and alone (`in_flight`
        steps on the stage, this one included) with the thread idle, else on the thread. Failures
        come in the future."""
        if not (
            self.inline_small_steps
            and self.queued == 0
            and in_flight == 1
            and sum(s.num_tokens for s in step.seqs) <= SMALL_STEP_TOKENS
        ):
            return self.on_thread(lambda: self._run(step, chain))
        future: asyncio.Future[StepOutput] = asyncio.get_running_loop().create_future()
        try:
            future.set_result(self._run(step, chain))
        except Exception as err:  # noqa: BLE001 - delivered through the future, as from the thread
            future.set_exception(err)
        return future

    def _run(self, step: ReceivedStep, chain: str) -> StepOutput:
        with step.times.computing():
            for sid in step.header.release_sequence_ids:
                self.engine.release(sid)
            return self.engine.run(step.seqs, step.hidden, alone=step.header.alone, chain=chain)

    def shutdown(self, *, wait: bool) -> None:
        """Stop the compute thread (after what it runs now, if `wait`)."""
        self.executor.shutdown(wait=wait)
