"""The coordinator's side of its members: the Registry service, and workers to and from the wire.

Owns `RegistryServicer` (served on the cluster port, apart from the client API): stage workers
register, heartbeat and deregister there; with mutual TLS only a `stage` certificate may, and a
worker that registers gets the key of the routes it is to follow. Also owns turning a reported
`WorkerInfo` into the registry's `Worker` and back (ClusterStatus shows no instance ids).
Knows nothing of requests or the schedule.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import grpc

from layerline.protos.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, tensor_pb2
from layerline.shared.access import STAGE, require
from layerline.shared.errors import Forbidden, InvalidInput, NoCapacity, status_of
from layerline.shared.rpc import grpc_status

from .cluster import Cluster
from .registry import Worker

log = logging.getLogger(__name__)


class RegistryServicer(coordinator_pb2_grpc.RegistryServicer):
    """Register, Heartbeat and Deregister, on the cluster port; with TLS, for stage certificates only."""

    def __init__(self, cluster: Cluster, *, heartbeat_interval: float, route_key: bytes, tls: bool) -> None:
        self.cluster = cluster
        self.heartbeat_interval = heartbeat_interval
        self.route_key = route_key  # given to each stage that registers: it follows only routes tagged with it
        self.tls = tls

    async def _member(self, context: grpc.aio.ServicerContext, action: str) -> None:
        try:
            require(context, (STAGE,), tls=self.tls, action=action)
        except Forbidden as err:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(err))

    async def Register(
        self, request: coordinator_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.RegisterResponse:
        await self._member(context, "Register")
        try:
            worker = worker_of(request.worker)
            known = self.cluster.registry.register(worker)
        except (InvalidInput, NoCapacity) as err:
            await context.abort(grpc_status(status_of(err)), str(err))
        except ValueError as err:  # a worker of another model
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        log.info(
            "worker %s registered: layers [%d, %d), pid %d",
            worker.address,
            worker.layer_start,
            worker.layer_end,
            worker.pid,
        )
        self.cluster.refresh()
        return coordinator_pb2.RegisterResponse(
            heartbeat_interval_ms=int(self.heartbeat_interval * 1000), known=known, route_key=self.route_key
        )

    async def Heartbeat(
        self, request: coordinator_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.HeartbeatResponse:
        await self._member(context, "Heartbeat")
        try:
            known = self.cluster.registry.heartbeat(worker_of(request.worker))
        except InvalidInput as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return coordinator_pb2.HeartbeatResponse(known=known)

    async def Deregister(
        self, request: coordinator_pb2.DeregisterRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.DeregisterResponse:
        await self._member(context, "Deregister")
        worker = self.cluster.registry.get(request.address)
        if worker is not None and worker.instance_id == request.instance_id:
            self.cluster.registry.remove(request.address)
            log.info("worker %s deregistered: %s", request.address, request.reason or "no reason given")
            self.cluster.refresh()
        return coordinator_pb2.DeregisterResponse()


def worker_of(info: common_pb2.WorkerInfo) -> Worker:
    """The registry's record of a worker, from what it reports."""
    return Worker(
        address=info.address,
        instance_id=info.instance_id,
        model_id=info.model_id,
        model_name=info.model_name,
        layer_start=info.layer_start,
        layer_end=info.layer_end,
        num_layers=info.num_layers,
        host=info.host,
        pid=info.pid,
        tp_size=info.tp_size,
        dtype=_enum_name(tensor_pb2.DType, info.dtype, "worker.dtype").lower(),
        device=info.device,
        kv_blocks_total=info.kv_blocks_total,
        kv_blocks_free=info.kv_blocks_free,
        kv_block_size=info.kv_block_size,
        in_flight_steps=info.in_flight_steps,
        active_sequences=info.active_sequences,
        weights_bytes=info.weights_bytes,
        state=_enum_name(common_pb2.WorkerState, info.state, "worker.state").removeprefix("WORKER_STATE_"),
        steps_computed=info.steps_computed,
        compute_seconds=info.compute_seconds,
        steps_run_ahead=info.steps_run_ahead,
        steps_run_ahead_dropped=info.steps_run_ahead_dropped,
        orphan_ttl=_seconds(info.orphan_ttl_seconds, "worker.orphan_ttl_seconds"),
    )


def worker_info(w: Worker) -> common_pb2.WorkerInfo:
    """What ClusterStatus shows of a worker: everything it reported but its instance id, which
    would let a caller pose as it."""
    state = f"WORKER_STATE_{w.state}"
    return common_pb2.WorkerInfo(
        address=w.address,
        host=w.host,
        pid=w.pid,
        model_id=w.model_id,
        model_name=w.model_name,
        layer_start=w.layer_start,
        layer_end=w.layer_end,
        num_layers=w.num_layers,
        dtype=w.dtype.upper(),  # the enum by name
        device=w.device,
        tp_size=w.tp_size,
        kv_blocks_total=w.kv_blocks_total,
        kv_blocks_free=w.kv_blocks_free,
        kv_block_size=w.kv_block_size,
        in_flight_steps=w.in_flight_steps,
        active_sequences=w.active_sequences,
        weights_bytes=w.weights_bytes,
        steps_computed=w.steps_computed,
        compute_seconds=w.compute_seconds,
        steps_run_ahead=w.steps_run_ahead,
        steps_run_ahead_dropped=w.steps_run_ahead_dropped,
        orphan_ttl_seconds=w.orphan_ttl,
        state=state if state in common_pb2.WorkerState.keys() else "WORKER_STATE_NOT_SERVING",
    )


def _enum_name(enum: Any, value: int, field: str) -> str:
    """The name of a reported enum value; InvalidInput for a value this coordinator does not know."""
    try:
        return str(enum.Name(value))
    except ValueError:
        raise InvalidInput(f"{field} = {value} is not one this coordinator knows") from None


def _seconds(value: float, field: str) -> float:
    """A reported duration; InvalidInput unless it is finite and not negative."""
    if not math.isfinite(value) or value < 0:
        raise InvalidInput(f"{field} = {value} must be a finite number of seconds, 0 or more")
    return value
