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
step's telemetry. A first stage may then run the next decode step ahead as a guess, once it knows
the tokens drawn (its own on a 1-stage chain, else from the last stage's acknowledgement) and if
nothing waits for the thread (`run_ahead`): a step that matches the guess takes its output, and
any other task drops it, and the KV it wrote, before it runs.
Knows nothing of frames, of gRPC or of where the result goes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from .engine import SequenceStep, StageEngine, StepOutput
from .frames import ReceivedStep
from .run_ahead import Guess, guess
from .run_ahead import enabled as run_ahead_enabled

T = TypeVar("T")
log = logging.getLogger(__name__)


def compute_thread() -> ThreadPoolExecutor:
    """The one thread a stage runs torch on: make it before loading, and load on it."""
    return ThreadPoolExecutor(1, thread_name_prefix="stage-compute")


class StageCompute:
    """The compute thread of a stage's engine."""

    def __init__(
        self, engine: StageEngine, *, executor: ThreadPoolExecutor | None = None, run_ahead: bool | None = None
    ) -> None:
        self.engine = engine
        self.executor = executor or compute_thread()
        wanted = run_ahead_enabled() if run_ahead is None else run_ahead
        # A first stage that is not tensor-parallel (a LeadingEngine would have to rewind every rank):
        # it draws the tokens itself, or hears them from the last stage.
        self.run_ahead = wanted and isinstance(engine, StageEngine) and engine.is_first
        self.submitted = 0  # tasks handed to the thread so far (counted on the event loop, read on the thread)
        self._taken = 0  # of them, those the thread began
        self.guesses = {"used": 0, "dropped": 0}
        self._guess: Guess | None = None  # only the compute thread touches it

    def on_thread(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run `fn` on the compute thread, after everything submitted before it."""
        self.submitted += 1
        return asyncio.get_running_loop().run_in_executor(self.executor, lambda: self._unguessed(fn))

    def start(self, step: ReceivedStep, *, chain: str = "") -> asyncio.Future[StepOutput]:
        """Begin computing a step that came by `chain`, after those before it. Failures come in the future."""
        self.submitted += 1
        step.chain = chain
        return asyncio.get_running_loop().run_in_executor(self.executor, lambda: self._run(step))

    def _unguessed(self, fn: Callable[[], T]) -> T:
        self._taken += 1
        self._drop_guess()
        return fn()

    def _drop_guess(self) -> None:
        guessed, self._guess = self._guess, None
        if guessed is not None:
            self.guesses["dropped"] += 1
            guessed.undo(self.engine)

    def _run(self, step: ReceivedStep) -> StepOutput:
        header, chain = step.header, step.chain
        self._taken += 1
        with step.times.computing():
            guessed = self._guess
            if guessed is not None and guessed.matches(
                step.seqs, chain=chain, alone=header.alone, releases=len(header.release_sequence_ids)
            ):
                self._guess = None
                self.guesses["used"] += 1
                out = guessed.out
            else:
                self._drop_guess()
                for sid in header.release_sequence_ids:
                    self.engine.release(sid)
                out = self.engine.run(step.seqs, step.hidden, alone=header.alone, chain=chain)
        step.since = self._taken  # a guess after it waits for nothing only while nothing more was submitted
        if self.run_ahead and header.run_ahead and self.engine.is_last:
            self._guess_after(step, out, {sid: d.token_id for sid, d in out.draws.items()})
        return out

    def drawn(self, step: ReceivedStep, out: StepOutput, tokens: Mapping[str, int]) -> None:
        """The last stage drew `tokens` after a step this first stage computed (on the event loop)."""
        if self.run_ahead and step.header.run_ahead and not self.engine.is_last:
            self._guess_after(step, out, tokens)

    def _guess_after(self, step: ReceivedStep, out: StepOutput, tokens: Mapping[str, int]) -> None:
        """Queue the step that follows `step` if the sequences go on with `tokens`, unless anything came since."""
        following = guess(step.seqs, out, tokens, ends=self.engine.config.eos_token_ids)
        if following is None or self.submitted != step.since:
            return
        try:
            self.executor.submit(self._ahead, following, step.chain, step.header.alone)
        except RuntimeError:  # shutting down: nothing runs ahead
            pass

    def _ahead(self, seqs: tuple[SequenceStep, ...], chain: str, alone: bool) -> None:
        """Compute a guessed step (a step submitted meanwhile waits for it: most often, the one guessed)."""
        self._drop_guess()  # never two at once: the KV of the first would stay
        whole = True
        try:
            out = self.engine.run(seqs, None, alone=alone, chain=chain)
        except Exception:  # a defect: the step itself runs as sent when it comes, and answers for it
            log.exception("a step run ahead failed; the next step runs as sent")
            out, whole = StepOutput(kept=list(seqs)), False
        self._guess = Guess(seqs, chain, alone, out)
        if out.errors or not whole:  # a guess that cannot run whole is no guess: what it wrote goes
            self._drop_guess()

    def shutdown(self, *, wait: bool) -> None:
        """Stop the compute thread (after what it runs now, if `wait`)."""
        self.executor.shutdown(wait=wait)
