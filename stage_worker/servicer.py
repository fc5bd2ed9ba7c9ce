"""The StageWorker gRPC service: protos in, calls to the stage's parts, protos out.

Owns who may call what (with mutual TLS, by the caller's certificate: only the coordinator
subscribes to Results, releases and probes; the coordinator and stages send steps), the bounds
of each request, and handing each Step stream to an `UpstreamStream` (`streams`), which turns its
frames into answered steps. Knows nothing of the model's math, the framing, where a step
computes or goes, or the schedule.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from layerline.protos.v1 import common_pb2, stage_pb2, stage_pb2_grpc
from layerline.shared.access import COORDINATOR, STAGE, require
from layerline.shared.errors import Forbidden

from .codec import CodecLimits
from .compute import ComputeThread, StageCompute
from .delivery import Delivery
from .engine import StageEngine
from .frames import StepRules
from .hops import NextHops
from .routing import RouteGuard
from .step_telemetry import StageTelemetry
from .streams import StageParts, UpstreamStream

log = logging.getLogger(__name__)
T = TypeVar("T")
MAX_SUBSCRIBER_BYTES = 128
MAX_RELEASED = 4096  # sequence ids in one Release call


@dataclass(frozen=True)
class StreamLimits:
    codec: CodecLimits  # what one received tensor may be
    max_message_bytes: int  # the gRPC message limit of the next hop
    max_chunk_bytes: int  # data bytes per hidden-state chunk this stage sends
    max_in_flight: int  # steps of one upstream stream received but not yet answered
    max_sequences: int  # sequences in one step


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
        routes: RouteGuard,
        tls: bool = False,
        compute_thread: ComputeThread | None = None,
    ) -> None:
        self.engine = engine
        self.routes = routes  # which routes this stage follows
        self.tls = tls  # mutual TLS: every caller's role is its certificate's
        self.telemetry = telemetry
        self.limits = limits
        self.worker_info = worker_info
        self.rules = StepRules(
            model_id=model_id,
            layers=engine.model.layer_range,
            is_first=engine.is_first,
            is_last=engine.is_last,
            max_sequences=limits.max_sequences,
            hidden_size=engine.config.hidden_size,
            max_step_tokens=engine.max_step_tokens,
            max_history=engine.config.max_position_embeddings,
        )
        self.compute = StageCompute(  # on the thread the engine was loaded on
            engine, executor=compute_thread, sends_whole=limits.max_chunk_bytes
        )
        self.delivery = Delivery(
            hops,
            is_last=engine.is_last,
            is_first=engine.is_first,
            hidden_size=engine.config.hidden_size,
            max_message_bytes=limits.max_message_bytes,
            max_chunk_bytes=limits.max_chunk_bytes,
        )
        self.delivery.on_drawn = self.compute.drawn
        self.parts = StageParts(
            rules=self.rules,
            codec=limits.codec,
            max_in_flight=limits.max_in_flight,
            routes=routes,
            compute=self.compute,
            delivery=self.delivery,
            address=lambda: worker_info().address,
        )

    @property
    def in_flight(self) -> int:
        """Steps of every stream received and not yet answered."""
        return self.parts.in_flight

    def on_compute_thread(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Run `fn` on the compute thread, after everything submitted before it."""
        return self.compute.on_thread(fn)

    async def Step(
        self, request_iterator: AsyncIterator[stage_pb2.StepFrame], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[stage_pb2.StepResult]:
        try:
            sender = require(context, (COORDINATOR, STAGE), tls=self.tls, action="Step")
        except Forbidden as err:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(err))
        stream = UpstreamStream(self.parts, sender=sender, telemetry=self.telemetry.stream())
        async for result in stream.answers(request_iterator):
            yield result

    async def Results(
        self, request: stage_pb2.ResultsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[stage_pb2.StepResult]:
        await self._require(context, (COORDINATOR,), action="Results")
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
        await self._require(context, (COORDINATOR,), action="Release")
        if len(request.sequence_ids) > MAX_RELEASED:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"sequence_ids holds {len(request.sequence_ids)} ids: at most {MAX_RELEASED} per call",
            )
        released = await self.on_compute_thread(lambda: sum(self.engine.release(s) for s in request.sequence_ids))
        self.telemetry.released()
        return stage_pb2.ReleaseResponse(released=released, kv_blocks_free=self.engine.cache.blocks_free)

    async def Info(self, request: stage_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> stage_pb2.InfoResponse:
        await self._require(context, (COORDINATOR,) if request.probe else (COORDINATOR, STAGE), action="Info")
        seconds = 0.0
        if request.probe:
            start = time.perf_counter()
            await self.on_compute_thread(self.engine.probe)
            seconds = time.perf_counter() - start
        return stage_pb2.InfoResponse(worker=self.worker_info(), probe_seconds=seconds)

    async def _require(self, context: grpc.aio.ServicerContext, roles: tuple[str, ...], *, action: str) -> None:
        """End the call with PERMISSION_DENIED unless the caller's role may do `action`."""
        try:
            require(context, roles, tls=self.tls, action=action)
        except Forbidden as err:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(err))
