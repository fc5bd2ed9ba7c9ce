"""The StageWorker gRPC service: protos in, calls to the stage's parts, protos out.

A Step stream's frames become steps (`frames`) that start computing in arrival order (`compute`)
and go on, in that order, to `delivery` (the next hop, or the last stage's answer); answers go up
as they come. Owns what answers a failed step: its status by kind (`shared.wire.status_message`),
this stage's address when a rank failed, a log of a defect; the stream keeps serving. The first
stage keeps acknowledgements of results the coordinator got directly off its stream.

Knows nothing of the model's math, the framing, where a step computes or goes, or the schedule.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import grpc

from layerline.protos.v1 import common_pb2, stage_pb2, stage_pb2_grpc
from layerline.shared.wire import status_message

from .codec import CodecLimits, FrameError
from .compute import StageCompute
from .delivery import Delivery
from .engine import StageEngine, StepInputError, StepOutput
from .frames import Pushed, ReceivedStep, StepAssembler, StepRules
from .hops import NextHops
from .ranks import RankFailed
from .step_telemetry import StageTelemetry, StreamTelemetry

log = logging.getLogger(__name__)
T = TypeVar("T")
_Started = tuple[ReceivedStep, asyncio.Future[StepOutput]]  # a step and its compute, begun
MAX_SUBSCRIBER_BYTES = 128


@dataclass(frozen=True)
class StreamLimits:
    codec: CodecLimits  # what one received tensor may be
    max_message_bytes: int  # the gRPC message limit of the next hop
    max_chunk_bytes: int  # data bytes per hidden-state chunk this stage sends
    max_in_flight: int  # steps of one upstream stream received but not yet answered
    max_sequences: int  # sequences in one step


class _Stream:
    """One upstream Step stream: its steps in arrival order, and its answers going up."""

    def __init__(self, telemetry: StreamTelemetry, *, max_in_flight: int) -> None:
        self.telemetry = telemetry
        self.outstanding = 0  # steps received and not yet answered
        self.reading = True  # False once every received step has been started and handed on
        self.ordered: asyncio.Queue[_Started | None] = asyncio.Queue(max_in_flight)  # None: no more steps
        self.answers: asyncio.Queue[stage_pb2.StepResult | None] = asyncio.Queue()  # None: the stream is done


class StageServicer(stage_pb2_grpc.StageWorkerServicer):
    def __init__(
        self,
        engine: StageEngine,
        *,
        model_id: str,
        limits: StreamLimits,
        hops: NextHops,
        worker_info: Callable[[], common_pb2.WorkerInfo],
        telemetry: StageTelemetry,
    ) -> None:
        self.engine = engine
        self.telemetry = telemetry
        self.limits = limits
        self.worker_info = worker_info
        self.rules = StepRules(
            model_id=model_id,
            layers=engine.model.layer_range,
            is_first=engine.is_first,
            is_last=engine.is_last,
            max_sequences=limits.max_sequences,
        )
        self.compute = StageCompute(engine)
        self.delivery = Delivery(
            hops,
            is_last=engine.is_last,
            hidden_size=engine.config.hidden_size,
            max_message_bytes=limits.max_message_bytes,
            max_chunk_bytes=limits.max_chunk_bytes,
        )
        self.in_flight = 0  # steps of every stream received and not yet answered

    def on_compute_thread(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run `fn` on the compute thread, after everything submitted before it."""
        return self.compute.on_thread(fn)

    async def Step(
        self, request_iterator: AsyncIterator[stage_pb2.StepFrame], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[stage_pb2.StepResult]:
        stream = _Stream(self.telemetry.stream(), max_in_flight=self.limits.max_in_flight)
        tasks = [asyncio.create_task(self._read(stream, request_iterator)), asyncio.create_task(self._forward(stream))]
        try:
            while (result := await stream.answers.get()) is not None:
                yield result
        finally:
            for task in tasks:
                task.cancel()
            stream.telemetry.close()

    async def _read(self, stream: _Stream, frames: AsyncIterator[stage_pb2.StepFrame]) -> None:
        """Reassemble steps and start each; a malformed step is answered with its error."""
        assembler = StepAssembler(self.rules, codec=self.limits.codec, telemetry=stream.telemetry)
        try:
            async for frame in frames:
                await self._take(stream, assembler.push(frame))
            await self._take(stream, assembler.end())
        finally:
            await stream.ordered.put(None)

    async def _take(self, stream: _Stream, pushed: Pushed) -> None:
        """Count the steps a frame began, answer those it rejected, start those it completed."""
        stream.outstanding += pushed.arrived
        self.in_flight += pushed.arrived
        for rejected in pushed.rejected:
            self._answer(stream, stage_pb2.StepResult(step_id=rejected.step_id, error=status_message(rejected.error)))
        for step in pushed.steps:
            step.times.ready()
            await stream.ordered.put((step, self.compute.start(step, in_flight=self.in_flight)))

    async def _forward(self, stream: _Stream) -> None:
        """Hand each computed step on, in arrival order; a failed one is answered with its error."""
        while (item := await stream.ordered.get()) is not None:
            step, future = item
            try:
                out = await future
            except Exception as err:  # noqa: BLE001 - each failure is answered on its step; defects are logged
                self._answer(stream, self._failure(step, err))
                continue
            await self.delivery.deliver(step, out, answer=partial(self._answer, stream))
        stream.reading = False
        if stream.outstanding == 0:
            stream.answers.put_nowait(None)

    def _failure(self, step: ReceivedStep, err: Exception) -> stage_pb2.StepResult:
        """The answer of a step whose compute raised `err` (called while handling it)."""
        result = stage_pb2.StepResult(step_id=step.header.step_id, error=status_message(err))
        if isinstance(err, RankFailed):  # this stage fails stop; the coordinator moves the work
            result.failed_address = self.worker_info().address
        elif not isinstance(err, (StepInputError, FrameError)):  # a defect: say so on the step, keep serving
            log.exception("step %d failed", step.header.step_id)
        return result

    def _answer(self, stream: _Stream, result: stage_pb2.StepResult) -> None:
        """A step's answer goes up (unless the coordinator has it already)."""
        stream.outstanding -= 1
        self.in_flight -= 1
        stream.telemetry.answered(
            result.step_id,
            error=result.error.message if result.error.code else None,
            sequence_errors=((r.sequence_id, r.error.message) for r in result.sequences if r.error.code),
        )
        if not (result.replied and self.engine.is_first):  # the coordinator has the result
            stream.answers.put_nowait(result)
        if not stream.reading and stream.outstanding == 0:
            stream.answers.put_nowait(None)

    async def Results(
        self, request: stage_pb2.ResultsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[stage_pb2.StepResult]:
        name = request.subscriber
        if not name or len(name.encode()) > MAX_SUBSCRIBER_BYTES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"subscriber must be 1 to {MAX_SUBSCRIBER_BYTES} bytes, got {len(name.encode())}",
            )
        queue = self.delivery.subscribers.open(name)
        try:
            await context.send_initial_metadata(())  # tells the subscriber it is registered
            while True:
                yield await queue.get()
        finally:
            self.delivery.subscribers.close(name, queue)

    async def Release(
        self, request: stage_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.ReleaseResponse:
        released = await self.on_compute_thread(lambda: sum(self.engine.release(s) for s in request.sequence_ids))
        self.telemetry.released()
        return stage_pb2.ReleaseResponse(released=released, kv_blocks_free=self.engine.cache.blocks_free)

    async def Info(self, request: stage_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> stage_pb2.InfoResponse:
        seconds = 0.0
        if request.probe:
            start = time.perf_counter()
            await self.on_compute_thread(self.engine.probe)
            seconds = time.perf_counter() - start
        return stage_pb2.InfoResponse(worker=self.worker_info(), probe_seconds=seconds)
