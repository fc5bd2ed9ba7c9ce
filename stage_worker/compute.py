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
import queue
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

import torch

from .codec import wire_tensor
from .engine import SequenceStep, StageEngine, StepOutput
from .frames import ReceivedStep
from .run_ahead import Guess, guess
from .run_ahead import enabled as run_ahead_enabled

T = TypeVar("T")
log = logging.getLogger(__name__)


class ComputeThread(Executor):
    """One thread running what it is given in submission order: an Executor (`submit`, for the
    loading), and `run` for the event loop, whose future the thread settles itself.

    `run` is ThreadPoolExecutor's `run_in_executor` without the concurrent future between them.
    Between two steps the event loop's code runs from caches the step's weights went through, so
    every line of a hand-off counts: in one process on 2 cores of an Intel Xeon, memory streamed
    between hand-offs as a step streams it, the loop's task began on the thread after 80-134 us
    this way against 210-272 through the executor, and the loop had the result after 187-311 us
    against 299-374 (medians of 40, three rounds each). As the executor's: a task whose future
    was cancelled before it began is skipped; the thread is not a daemon, and the interpreter,
    exiting, lets it finish what was submitted (`shutdown(wait=False)` does not cut a step off)."""

    def __init__(self, name: str = "stage-compute") -> None:
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # `submit` and `shutdown` from any thread: nothing queued after the end
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name)
        self._thread.start()
        threading._register_atexit(self.shutdown, wait=False)  # type: ignore[attr-defined]  # as concurrent.futures does

    def run(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run `fn` on the thread after everything submitted before it; its outcome in the future."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._put(_LoopTask(fn, future, loop))
        return future

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        self._put(_ExecutorTask(lambda: fn(*args, **kwargs), future))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more tasks; the thread ends after those submitted (and is waited for, if `wait`)."""
        if cancel_futures:
            raise NotImplementedError("a stage's compute thread always runs what was submitted")
        with self._lock:
            if not self._closed:
                self._closed = True
                self._tasks.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _put(self, task: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the compute thread is shut down")
            self._tasks.put(task)

    def _serve(self) -> None:
        while (task := self._tasks.get()) is not None:
            try:
                task()
            except BaseException:  # a task hands its own errors on: this is a defect; the thread goes on
                log.critical("the compute thread's task failed", exc_info=True)
            del task  # nothing of it is kept while the thread waits


class _LoopTask:
    """`fn`, its outcome for an event loop's future."""

    __slots__ = ("fn", "future", "loop")

    def __init__(self, fn: Callable[[], Any], future: asyncio.Future[Any], loop: asyncio.AbstractEventLoop) -> None:
        self.fn, self.future, self.loop = fn, future, loop

    def __call__(self) -> None:
        if self.future.done():  # cancelled before it began
            return
        try:
            result = self.fn()
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting task
            self._settle(None, err)
            del self  # the error's traceback holds this frame: not the future that holds the error
        else:
            self._settle(result, None)

    def _settle(self, result: object, err: BaseException | None) -> None:
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, result, err)
        except RuntimeError:  # the loop is closed: nothing awaits it
            pass


class _ExecutorTask:
    """`fn`, its outcome for a concurrent future (`Executor.submit`'s)."""

    __slots__ = ("fn", "future")

    def __init__(self, fn: Callable[[], Any], future: Future[Any]) -> None:
        self.fn, self.future = fn, future

    def __call__(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = self.fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            self.future.set_exception(err)
            del self  # as _LoopTask's
        else:
            self.future.set_result(result)


def _settle(future: asyncio.Future[Any], result: object, err: BaseException | None) -> None:
    if future.done():
        return
    if err is None:
        future.set_result(result)
    else:
        future.set_exception(err)


def stay_in_inference_mode() -> None:
    """The calling thread (a stage's compute thread, its model loaded) in torch's inference mode from
    now on, as every step runs: a step then neither enters nor leaves it, which took 40 us of a lone
    token's step, its caches cold (one process, 2 cores of an Intel Xeon, family 6 model 106). Its
    tensors are inference tensors, read anywhere; none of them is changed in place on another thread."""
    _held.inference = torch.inference_mode()  # the mode lasts while its context is held: the thread's life
    _held.inference.__enter__()


_held = threading.local()


def compute_thread() -> ComputeThread:
    """The one thread a stage runs torch on: make it before loading, and load on it."""
    return ComputeThread()


class StageCompute:
    """The compute thread of a stage's engine."""

    def __init__(
        self,
        engine: StageEngine,
        *,
        executor: ComputeThread | None = None,
        run_ahead: bool | None = None,
        sends_whole: int = 1 << 20,
    ) -> None:
        self.engine = engine
        # Outputs of at most this many bytes (those the next hop gets in one frame, delivery.py)
        # are made wire bytes on this thread; larger ones are cut into frames on the event loop.
        self.sends_whole = sends_whole
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
        return self.executor.run(lambda: self._unguessed(fn))

    def start(self, step: ReceivedStep, *, chain: str = "") -> asyncio.Future[StepOutput]:
        """Begin computing a step that came by `chain`, after those before it. Failures come in the future."""
        self.submitted += 1
        step.chain = chain
        return self.executor.run(lambda: self._run(step))

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
            hidden = out.hidden
            if hidden is not None and not self.engine.is_last and hidden.nbytes <= self.sends_whole:
                step.sent = wire_tensor(hidden)  # what the next hop gets, made here (codec.WireTensor)
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
