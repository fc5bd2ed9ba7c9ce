"""The StageWorker gRPC service: frames in, engine steps, frames out to the next hop.

Owns the Step stream protocol: reassembling each step (a header frame, carrying the hidden
states itself when they fit in one message, else followed by their chunks), handing it to the
engine in arrival order, sending the result down the route (or, on the last stage, answering
with the sampled tokens: on the Results stream the step names, if open, with only an
acknowledgement up the chain), and merging the downstream answer with this stage's own
per-sequence errors on the way back up. Torch runs on the engine's single compute thread, so
the next step is received and the previous one sent while this one computes; the one exception
is a step of a few tokens alone on the stage, which runs on the event loop (nothing else waits
on it then).

Typed failures answer with the status of their kind (`layerline.shared.errors.STATUS_OF`). With telemetry on, each step
carries a `StepTimes` that the stream's hooks feed; what is measured is `step_telemetry`'s.
Knows nothing of the model's math or of the coordinator's schedule.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TypeVar

import grpc
import torch

from layerline.protos.v1 import common_pb2, stage_pb2, stage_pb2_grpc, tensor_pb2
from layerline.shared.wire import sampling_from_wire, status_message

from .codec import CodecLimits, FrameError, Reassembler, chunk
from .engine import SMALL_STEP_TOKENS, SequenceError, SequenceStep, StageEngine, StepInputError, StepOutput
from .hops import NextHops
from .ranks import LeadingEngine, RankFailed
from .step_telemetry import StageTelemetry, StepTimes, StreamTelemetry

log = logging.getLogger(__name__)
T = TypeVar("T")
FRAME_OVERHEAD_BYTES = 32  # field tags and lengths around a header and its hidden chunk
MAX_SUBSCRIBER_BYTES = 128
MAX_UNSENT_RESULTS = 256  # direct results waiting on one Results stream; beyond, they go up the chain


def status_of(err: Exception) -> common_pb2.Status:
    return status_message(err)


@dataclass(frozen=True)
class StreamLimits:
    codec: CodecLimits  # what one received tensor may be
    max_message_bytes: int  # the gRPC message limit of the next hop
    max_chunk_bytes: int  # data bytes per hidden-state chunk this stage sends
    max_in_flight: int  # steps of one upstream stream received but not yet answered
    max_sequences: int  # sequences in one step


@dataclass
class _Step:
    header: stage_pb2.StepHeader
    seqs: list[SequenceStep]
    hidden: torch.Tensor | None = None
    times: StepTimes | None = None  # when telemetry is on


class StageServicer(stage_pb2_grpc.StageWorkerServicer):
    def __init__(
        self,
        engine: StageEngine,
        *,
        model_id: str,
        limits: StreamLimits,
        hops: NextHops,
        worker_info: Callable[[], common_pb2.WorkerInfo],
        telemetry: StageTelemetry | None = None,
    ) -> None:
        self.engine = engine
        self.telemetry = telemetry
        self.model_id = model_id
        self.limits = limits
        self.hops = hops
        self.worker_info = worker_info
        self.compute = ThreadPoolExecutor(1, thread_name_prefix="stage-compute")
        self.queued = 0  # calls submitted to the compute thread and not yet finished
        self.in_flight = 0
        self.steps_computed = 0  # since the start, and their compute time: see WorkerInfo
        self.compute_seconds = 0.0
        # A step of a few tokens runs on the event loop itself when it is the only step here
        # and the compute thread is idle: two thread handoffs cost more than such a step, and
        # with no other step in flight the loop has no answer to relay meanwhile. Tensor-
        # parallel rank 0 always uses the compute thread, shared with the keepalive collective.
        self.inline_small_steps = not isinstance(engine, LeadingEngine)
        self._subscribers: dict[str, asyncio.Queue[stage_pb2.StepResult]] = {}  # open Results streams

    def on_compute_thread(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run `fn` on the compute thread, after everything submitted before it."""
        self.queued += 1
        future = asyncio.get_running_loop().run_in_executor(self.compute, fn)
        future.add_done_callback(self._computed)
        return future

    def _computed(self, _: asyncio.Future[object]) -> None:
        self.queued -= 1

    def _start(self, step: _Step) -> asyncio.Future[StepOutput]:
        """Begin computing a step: inline if it is small and alone here, else on the thread."""
        if not (
            self.inline_small_steps
            and self.queued == 0
            and self.in_flight == 1
            and sum(s.num_tokens for s in step.seqs) <= SMALL_STEP_TOKENS
        ):
            return self.on_compute_thread(lambda: self._run(step))
        future: asyncio.Future[StepOutput] = asyncio.get_running_loop().create_future()
        try:
            future.set_result(self._run(step))
        except Exception as err:  # noqa: BLE001 - delivered through the future, as from the thread
            future.set_exception(err)
        return future

    # -- Step --------------------------------------------------------------------------------

    async def Step(
        self, request_iterator: AsyncIterator[stage_pb2.StepFrame], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[stage_pb2.StepResult]:
        answers: asyncio.Queue[stage_pb2.StepResult | None] = asyncio.Queue()
        ordered: asyncio.Queue[tuple[_Step, asyncio.Future[StepOutput]] | None] = asyncio.Queue(
            self.limits.max_in_flight
        )
        outstanding = 0  # steps of this stream received and not yet answered
        reading = True
        traced = self.telemetry.stream() if self.telemetry is not None else None

        def received() -> None:
            nonlocal outstanding
            outstanding += 1
            self.in_flight += 1

        def answer(result: stage_pb2.StepResult) -> None:
            nonlocal outstanding
            outstanding -= 1
            self.in_flight -= 1
            if traced is not None:
                _answered(traced, result)
            if not (result.replied and self.engine.is_first):  # the coordinator has the result
                answers.put_nowait(result)
            if not reading and outstanding == 0:
                answers.put_nowait(None)

        async def read() -> None:
            try:
                async for step in self._steps(request_iterator, answer_error=answer, received=received, traced=traced):
                    if step.times is not None:
                        step.times.ready()
                    future = self._start(step)
                    await ordered.put((step, future))
            finally:
                await ordered.put(None)

        async def forward() -> None:
            nonlocal reading
            while (item := await ordered.get()) is not None:
                step, future = item
                try:
                    out = await future
                except (StepInputError, FrameError) as err:
                    answer(stage_pb2.StepResult(step_id=step.header.step_id, error=status_of(err)))
                    continue
                except RankFailed as err:  # this stage fails stop; the coordinator moves the work
                    answer(
                        stage_pb2.StepResult(
                            step_id=step.header.step_id, error=status_of(err), failed_address=self.worker_info().address
                        )
                    )
                    continue
                except Exception as err:  # a defect: say so on the step, keep the stream serving
                    log.exception("step %d failed", step.header.step_id)
                    answer(stage_pb2.StepResult(step_id=step.header.step_id, error=status_of(err)))
                    continue
                await self._deliver(step, out, answer)
            reading = False
            if outstanding == 0:
                answers.put_nowait(None)

        tasks = [asyncio.create_task(read()), asyncio.create_task(forward())]
        try:
            while (result := await answers.get()) is not None:
                yield result
        finally:
            for task in tasks:
                task.cancel()
            if traced is not None:
                traced.close()

    async def _steps(
        self,
        frames: AsyncIterator[stage_pb2.StepFrame],
        *,
        answer_error: Callable[[stage_pb2.StepResult], None],
        received: Callable[[], None],
        traced: StreamTelemetry | None,
    ) -> AsyncIterator[_Step]:
        """Reassemble steps from frames; a malformed step is answered with its error and skipped."""
        reassembler = Reassembler(limits=self.limits.codec)
        current: _Step | None = None
        failed_id: int | None = None  # skip the chunks of a step already answered with an error
        async for frame in frames:
            kind = frame.WhichOneof("frame")
            if kind == "header":
                if current is not None:
                    answer_error(
                        _error_result(current, "a new header arrived before the step's hidden states were complete")
                    )
                    reassembler.reset()
                current, failed_id = None, None
                received()
                try:
                    current = _Step(frame.header, self._decode_header(frame.header))
                except StepInputError as err:
                    answer_error(stage_pb2.StepResult(step_id=frame.header.step_id, error=status_of(err)))
                    failed_id = frame.header.step_id
                    continue
                if traced is not None:
                    current.times = traced.received(
                        frame.header.step_id,
                        current.seqs,
                        [s.trace_context for s in frame.header.sequences],
                        header_bytes=frame.header.ByteSize(),
                    )
                if frame.header.HasField("hidden"):  # the whole tensor, in the header
                    started = time.perf_counter()
                    try:
                        current.hidden = _hidden_states(reassembler, frame.header.hidden, whole=True)
                    except FrameError as err:
                        answer_error(stage_pb2.StepResult(step_id=frame.header.step_id, error=status_of(err)))
                        failed_id, current = frame.header.step_id, None
                        continue
                    if current.times is not None:  # its bytes were counted with the header's
                        current.times.chunk(0, time.perf_counter() - started)
                if self.engine.is_first or current.hidden is not None:
                    yield current
                    current = None
            elif kind == "hidden_chunk":
                if current is None:
                    if failed_id is None:
                        received()
                        answer_error(_error_result(None, "hidden_chunk frame without a step header before it"))
                        failed_id = 0
                    continue
                started = time.perf_counter()
                try:
                    tensor = _hidden_states(reassembler, frame.hidden_chunk, whole=False)
                except FrameError as err:
                    answer_error(stage_pb2.StepResult(step_id=current.header.step_id, error=status_of(err)))
                    failed_id, current = current.header.step_id, None
                    reassembler.reset()
                    continue
                if current.times is not None:
                    current.times.chunk(frame.ByteSize(), time.perf_counter() - started)
                if tensor is not None:
                    current.hidden = tensor
                    yield current
                    current = None
        if current is not None:
            answer_error(_error_result(current, "the stream ended before the step's hidden states were complete"))

    def _decode_header(self, header: stage_pb2.StepHeader) -> list[SequenceStep]:
        if header.model_id and header.model_id != self.model_id:
            raise StepInputError(f"step model_id {header.model_id!r} differs from this stage's {self.model_id!r}")
        if len(header.sequences) > self.limits.max_sequences:
            raise StepInputError(
                f"step carries {len(header.sequences)} sequences, above the limit of {self.limits.max_sequences}"
            )
        ids = [s.sequence_id for s in header.sequences]
        if len(set(ids)) < len(ids):
            twice = next(i for i in ids if ids.count(i) > 1)
            raise StepInputError(f"sequence {twice!r} appears twice in one step")
        if self.engine.is_last and header.route:
            raise StepInputError("route must be empty at the last stage")
        if not self.engine.is_last and not header.route:
            raise StepInputError(f"stage {self.engine.model.layer_range} is not the last: route must name the next hop")
        return [_sequence_step(s, last=self.engine.is_last) for s in header.sequences]

    def _run(self, step: _Step) -> StepOutput:
        with step.times.computing() if step.times is not None else nullcontext():
            for sid in step.header.release_sequence_ids:
                self.engine.release(sid)
            started = time.perf_counter()
            out = self.engine.run(step.seqs, step.hidden, alone=step.header.alone)
            self.compute_seconds += time.perf_counter() - started
            self.steps_computed += 1
            return out

    async def _deliver(self, step: _Step, out: StepOutput, answer: Callable[[stage_pb2.StepResult], None]) -> None:
        order = [s.sequence_id for s in step.seqs]
        local = {e.sequence_id: e for e in out.errors}
        if self.engine.is_last:
            result = _merge(step.header.step_id, order, local, _draw_results(step, out))
            if step.header.HasField("reply") and self._reply(step.header.reply, result):
                answer(stage_pb2.StepResult(step_id=step.header.step_id, replied=True))
            else:
                answer(result)
            return
        kept = {s.sequence_id for s in out.kept}
        header = stage_pb2.StepHeader(
            step_id=step.header.step_id,
            model_id=step.header.model_id,
            sequences=[s for s in step.header.sequences if s.sequence_id in kept and s.sequence_id not in local],
            route=step.header.route[1:],
            release_sequence_ids=step.header.release_sequence_ids,
            alone=step.header.alone,
        )
        if step.header.HasField("reply") and len(header.sequences) == len(step.header.sequences):
            header.reply.CopyFrom(step.header.reply)  # dropped with a sequence: see stage.proto
        assert out.hidden is not None or not out.kept
        hidden = out.hidden if out.hidden is not None else torch.empty(0, self.engine.config.hidden_size)
        started = time.perf_counter()
        chunks = list(chunk(hidden, self.limits.max_chunk_bytes))
        frames: list[stage_pb2.StepFrame] = []
        if len(chunks) == 1 and (  # one message for the step, if the header leaves it room
            header.ByteSize() + chunks[0].ByteSize() + FRAME_OVERHEAD_BYTES <= self.limits.max_message_bytes
        ):
            header.hidden.CopyFrom(chunks[0])
        else:
            frames = [stage_pb2.StepFrame(hidden_chunk=c) for c in chunks]
        if step.times is not None:  # each request's hop span goes into its carrier; frames are counted
            carriers = ((s.sequence_id, s.trace_context) for s in header.sequences)
            frames = step.times.forwarding(
                step.header.route[0],
                carriers,
                frames,
                header_size=header.ByteSize,
                serialize_seconds=time.perf_counter() - started,
            )

        def deliver(result: stage_pb2.StepResult) -> None:
            if result.replied or (result.HasField("error") and result.error.code):
                answer(result)
                return
            down = {r.sequence_id: r for r in result.sequences}
            answer(_merge(result.step_id, order, local, down))

        await self.hops.get(step.header.route[0]).send(header, frames, deliver=deliver)
        if step.times is not None:  # this stage's part is done; the result goes to the coordinator
            step.times.end(error=None, sequence_errors={sid: str(e.error) for sid, e in local.items()})

    def _reply(self, reply: stage_pb2.DirectReply, result: stage_pb2.StepResult) -> bool:
        """Queue a step's result for the subscriber its header names; False if that cannot be."""
        queue = self._subscribers.get(reply.subscriber)
        if queue is None or queue.qsize() >= MAX_UNSENT_RESULTS:
            return False
        result.step_id = reply.step_id
        queue.put_nowait(result)
        return True

    # -- Results, Release and Info -----------------------------------------------------------

    async def Results(
        self, request: stage_pb2.ResultsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[stage_pb2.StepResult]:
        name = request.subscriber
        if not name or len(name.encode()) > MAX_SUBSCRIBER_BYTES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"subscriber must be 1 to {MAX_SUBSCRIBER_BYTES} bytes, got {len(name.encode())}",
            )
        queue: asyncio.Queue[stage_pb2.StepResult] = asyncio.Queue()
        self._subscribers[name] = queue  # a reconnecting subscriber replaces its old stream
        try:
            await context.send_initial_metadata(())  # tells the subscriber it is registered
            while True:
                yield await queue.get()
        finally:
            if self._subscribers.get(name) is queue:
                del self._subscribers[name]

    async def Release(
        self, request: stage_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.ReleaseResponse:
        released = await self.on_compute_thread(lambda: sum(self.engine.release(s) for s in request.sequence_ids))
        if self.telemetry is not None:
            self.telemetry.released()
        return stage_pb2.ReleaseResponse(released=released, kv_blocks_free=self.engine.cache.blocks_free)

    async def Info(self, request: stage_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> stage_pb2.InfoResponse:
        seconds = 0.0
        if request.probe:
            start = time.perf_counter()
            await self.on_compute_thread(self.engine.probe)
            seconds = time.perf_counter() - start
        return stage_pb2.InfoResponse(worker=self.worker_info(), probe_seconds=seconds)


def _hidden_states(reassembler: Reassembler, piece: tensor_pb2.TensorChunk, *, whole: bool) -> torch.Tensor | None:
    """Add one chunk of a step's hidden states; the tensor once complete. `whole`: it must be."""
    tensor = reassembler.add(piece)
    if tensor is None and whole:
        reassembler.reset()
        raise FrameError(
            f"header.hidden holds {len(piece.data)} of the tensor's {piece.total_bytes} bytes: "
            "a header carries its hidden states whole, or sends them as hidden_chunk frames"
        )
    if tensor is not None and not tensor.is_floating_point():
        raise FrameError(f"hidden states have dtype {tensor.dtype}; a floating dtype is required")
    return tensor


def _sequence_step(msg: stage_pb2.SequenceInput, *, last: bool) -> SequenceStep:
    sampling = sampling_from_wire(msg.sampling) if last and msg.sample else None
    return SequenceStep(
        sequence_id=msg.sequence_id,
        positions=tuple(msg.positions),
        token_ids=tuple(msg.token_ids),
        sampling=sampling,
        history=tuple(msg.history_token_ids),
        prefix_from=msg.prefix_from,
    )


def _draw_results(step: _Step, out: StepOutput) -> dict[str, stage_pb2.SequenceResult]:
    results: dict[str, stage_pb2.SequenceResult] = {}
    wants = {s.sequence_id: s for s in step.header.sequences}
    for seq in out.kept:
        result = stage_pb2.SequenceResult(sequence_id=seq.sequence_id)
        draw = out.draws.get(seq.sequence_id)
        asked = wants[seq.sequence_id]
        if draw is not None and asked.sample:
            result.sampled_token_id = draw.token_id
            if draw.logprob is not None:
                result.logprob = draw.logprob
                result.top_logprobs.extend(common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in draw.top)
        results[seq.sequence_id] = result
    return results


def _merge(
    step_id: int,
    order: list[str],
    local: dict[str, SequenceError],
    down: dict[str, stage_pb2.SequenceResult],
) -> stage_pb2.StepResult:
    result = stage_pb2.StepResult(step_id=step_id)
    for sid in order:
        if sid in local:
            result.sequences.add(sequence_id=sid, error=status_of(local[sid].error))
        elif sid in down:
            result.sequences.append(down[sid])
    return result


def _answered(traced: StreamTelemetry, result: stage_pb2.StepResult) -> None:
    """Tell the stream's telemetry that a step's answer went up, and what failed in it."""
    traced.answered(
        result.step_id,
        error=result.error.message if result.error.code else None,
        sequence_errors={r.sequence_id: r.error.message for r in result.sequences if r.error.code},
    )


def _error_result(step: _Step | None, message: str) -> stage_pb2.StepResult:
    step_id = step.header.step_id if step is not None else 0
    return stage_pb2.StepResult(step_id=step_id, error=status_of(FrameError(message)))
