"""One upstream Step stream: its frames in, its steps computed in arrival order, its answers out.

A Step stream's frames become steps (`frames`), each checked against the routes this stage follows
(`routing`), that start computing in arrival order (`compute`) and go on, in that order, to
`delivery` (the next hop, or the last stage's answer); answers go up as they come. Owns what
answers a failed step: its status by kind (`shared.wire.status_message`), this stage's address
when a rank failed, a log of a defect; the stream keeps serving. The first stage keeps the
acknowledgements of results the coordinator got directly off its stream.

Knows nothing of gRPC (the servicer hands in the frames and yields the answers) or the model.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from layerline.protos.v1 import stage_pb2
from layerline.shared.errors import Forbidden, InvalidInput
from layerline.shared.wire import status_message

from .codec import CodecLimits, FrameError
from .compute import StageCompute
from .delivery import Delivery
from .engine import StepInputError, StepOutput
from .frames import Pushed, ReceivedStep, StepAssembler, StepRules
from .ranks import RankFailed
from .routing import RouteGuard
from .step_telemetry import StreamTelemetry

log = logging.getLogger(__name__)
_Started = tuple[ReceivedStep, asyncio.Future[StepOutput]]  # a step and its compute, begun


@dataclass
class StageParts:
    """What every upstream stream of a stage shares."""

    rules: StepRules  # what a step's header must satisfy here
    codec: CodecLimits  # what one received tensor may be
    max_in_flight: int  # steps of one stream received but not yet answered
    routes: RouteGuard  # which routes this stage follows
    compute: StageCompute  # where steps compute
    delivery: Delivery  # where computed steps go
    address: Callable[[], str]  # this stage's address, named when a rank failed
    in_flight: int = field(default=0)  # steps of every stream received and not yet answered


class UpstreamStream:
    """The steps of one Step stream in arrival order, and its answers going up."""

    def __init__(self, parts: StageParts, *, sender: str | None, telemetry: StreamTelemetry) -> None:
        self.parts = parts
        self.sender = sender  # the caller's role (None with TLS off)
        self.telemetry = telemetry
        self.outstanding = 0  # steps received and not yet answered
        self.reading = True  # False once every received step has been started and handed on
        self.ordered: asyncio.Queue[_Started | None] = asyncio.Queue(parts.max_in_flight)  # None: no more steps
        self.results: asyncio.Queue[stage_pb2.StepResult | None] = asyncio.Queue()  # None: the stream is done

    async def answers(self, frames: AsyncIterator[stage_pb2.StepFrame]) -> AsyncIterator[stage_pb2.StepResult]:
        """The stream's answers as they come, until every received step is answered."""
        tasks = [asyncio.create_task(self._read(frames)), asyncio.create_task(self._forward())]
        try:
            while (result := await self.results.get()) is not None:
                yield result
        finally:
            for task in tasks:
                task.cancel()
            self.telemetry.close()

    async def _read(self, frames: AsyncIterator[stage_pb2.StepFrame]) -> None:
        """Reassemble steps and start each; a malformed step is answered with its error."""
        assembler = StepAssembler(self.parts.rules, codec=self.parts.codec, telemetry=self.telemetry)
        try:
            async for frame in frames:
                await self._take(assembler.push(frame))
            await self._take(assembler.end())
        finally:
            await self.ordered.put(None)

    async def _take(self, pushed: Pushed) -> None:
        """Count the steps a frame began, answer those it rejected, start those it completed."""
        parts = self.parts
        self.outstanding += pushed.arrived
        parts.in_flight += pushed.arrived
        for rejected in pushed.rejected:
            self._answer(stage_pb2.StepResult(step_id=rejected.step_id, error=status_message(rejected.error)))
        for step in pushed.steps:
            try:
                chain = parts.routes.check(step.header, sender=self.sender)
            except (Forbidden, InvalidInput) as err:
                self._answer(stage_pb2.StepResult(step_id=step.header.step_id, error=status_message(err)))
                continue
            step.times.ready()
            await self.ordered.put((step, parts.compute.start(step, chain=chain)))

    async def _forward(self) -> None:
        """Hand each computed step on, in arrival order; a failed one is answered with its error."""
        while (item := await self.ordered.get()) is not None:
            step, future = item
            try:
                out = await future
            except Exception as err:  # noqa: BLE001 - each failure is answered on its step; defects are logged
                self._answer(self._failure(step, err))
                continue
            await self.parts.delivery.deliver(step, out, answer=self._answer)
        self.reading = False
        if self.outstanding == 0:
            self.results.put_nowait(None)

    def _failure(self, step: ReceivedStep, err: Exception) -> stage_pb2.StepResult:
        """The answer of a step whose compute raised `err` (called while handling it)."""
        result = stage_pb2.StepResult(step_id=step.header.step_id, error=status_message(err))
        if isinstance(err, RankFailed):  # this stage fails stop; the coordinator moves the work
            result.failed_address = self.parts.address()
        elif not isinstance(err, (StepInputError, FrameError)):  # a defect: say so on the step, keep serving
            log.exception("step %d failed", step.header.step_id)
        return result

    def _answer(self, result: stage_pb2.StepResult) -> None:
        """A step's answer goes up (unless the coordinator has it already)."""
        self.outstanding -= 1
        self.parts.in_flight -= 1
        self.telemetry.answered(
            result.step_id,
            error=result.error.message if result.error.code else None,
            sequence_errors=((r.sequence_id, r.error.message) for r in result.sequences if r.error.code),
        )
        if not (result.replied and self.parts.rules.is_first):  # the coordinator has the result
            self.results.put_nowait(result)
        if not self.reading and self.outstanding == 0:
            self.results.put_nowait(None)
