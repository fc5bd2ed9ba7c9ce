"""A stage worker process: load the layers, serve them over gRPC, stop cleanly on SIGTERM.

Owns model loading and KV pool sizing (as `StageSettings` say), the gRPC
server with the StageWorker and standard health services, its telemetry, and the process
lifecycle. Health is SERVING only once the weights are loaded and a real one-token forward has
run, NOT_SERVING while stopping.

Knows nothing of the coordinator's schedule; argument parsing stays in the CLI.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2

from layerline.model_store import resolve_model
from layerline.protos.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc
from layerline.shared.model_config import LayerRange, ModelConfig
from layerline.shared.ports import free_port
from layerline.shared.rpc import aio_channel, listen_on, server_options
from layerline.shared.services import add_servicer, health_only_server
from layerline.shared.settings import to_json
from layerline.shared.telemetry import Telemetry
from layerline.shared.tls import member_files

from . import tp_group
from .codec import CodecLimits, dtype_to_wire
from .compute import compute_thread, stay_in_inference_mode
from .engine import StageEngine
from .hops import NextHops
from .kv_cache import CacheShape, PagedKVCache
from .orphans import Orphans
from .parallel import TensorParallel
from .ranks import LeadingEngine, RankFailed, follow
from .routing import RouteGuard
from .servicer import StageServicer, StreamLimits
from .settings import StageSettings
from .step_telemetry import StageTelemetry
from .weights import held_bytes, load_stage, model_id

log = logging.getLogger("layerline.stage")

KEEPALIVE_SECONDS = 2.0  # how often rank 0 checks on idle tensor-parallel ranks

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # DTYPES


class StageWorker:
    """A loaded stage and the gRPC server around it."""

    def __init__(self, settings: StageSettings) -> None:
        self.settings = settings
        if settings.threads:
            torch.set_num_threads(settings.threads)
        self.checkpoint = resolve_model(settings.model)
        self.config = ModelConfig.from_checkpoint(self.checkpoint)
        self.layers = LayerRange.parse(settings.layers, num_layers=self.config.num_layers)
        self.dtype = TORCH_DTYPES[settings.dtype]
        self.model_id = model_id(self.checkpoint, quantize=settings.quantize)
        self.instance_id = uuid.uuid4().hex
        self.address = ""
        self.state = common_pb2.WORKER_STATE_STARTING
        self.engine: StageEngine | None = None
        self.servicer: StageServicer | None = None
        self.followers: list[subprocess.Popen[bytes]] = []  # ranks 1.. of a tensor-parallel stage
        self.compute_thread = compute_thread()  # all torch work runs there, loading included (compute.py)
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]  # not in grpc-stubs
        self.failed = False  # a rank of this tensor-parallel stage died or hung
        self.weights_bytes = 0  # of this rank's shards, once loaded
        self.routes = RouteGuard(address=lambda: self.address)  # its key comes with the registration
        self.member_credentials: grpc.ChannelCredentials | None = None  # mutual TLS to the other members

    def build_engine(self, tp: TensorParallel) -> StageEngine:
        """Load this rank's shards and preallocate its KV pool (the same block count on every rank)."""
        start = time.perf_counter()
        model = load_stage(
            self.checkpoint,
            self.layers,
            dtype=self.dtype,
            device=self.settings.device,
            config=self.config,
            tp=tp,
            weight_layout=self.settings.weight_layout,
            quantize=self.settings.quantize,
        )
        shape = CacheShape.for_budget(
            self.settings.kv_memory_bytes,
            block_size=self.settings.kv_block_size,
            num_kv_heads=model.shards.num_kv_heads,
            head_dim=self.config.head_dim,
            num_layers=len(self.layers),
            dtype=self.dtype,
        )
        cache = PagedKVCache(shape, layer_ids=self.layers, dtype=self.dtype, device=self.settings.device)
        params = sum(p.numel() for p in model.parameters())
        log.info(
            "rank %d/%d loaded layers %s of %s (%s params, %s, quantize %s, %s) in %.1fs; "
            "KV pool %d blocks x %d tokens",
            tp.rank,
            tp.size,
            self.layers,
            self.checkpoint,
            f"{params:,}",
            self.settings.dtype,
            self.settings.quantize,
            self.settings.device,
            time.perf_counter() - start,
            shape.num_blocks,
            shape.block_size,
        )
        return StageEngine(
            model,
            cache,
            max_step_tokens=self.settings.max_step_tokens,
            prefill_threads=self.settings.prefill_threads,
            samples=tp.rank == 0,
        )

    def load(self) -> None:
        s = self.settings
        engine: StageEngine
        if s.tp == 1:
            engine = self.build_engine(TensorParallel())
        else:
            master = f"127.0.0.1:{free_port()}"
            self.followers = tp_group.spawn_followers(to_json(s), size=s.tp, master=master)
            followers = self.followers
            tp = tp_group.join_group(
                rank=0,
                size=s.tp,
                master=master,
                timeout_s=s.tp_timeout,
                device=s.device,
                gone=lambda: tp_group.gone(followers),
            )
            engine = LeadingEngine(self.build_engine(tp), tp.group)  # type: ignore[assignment]  # its proxy
        self.weights_bytes = held_bytes(engine.model)  # parameters, packed weights
        engine.probe()
        self.engine = engine

    def info(self) -> common_pb2.WorkerInfo:
        engine = self.engine
        guesses = self.servicer.compute.guesses if self.servicer else {"used": 0, "dropped": 0}
        return common_pb2.WorkerInfo(
            address=self.address,
            host=socket.gethostname(),
            pid=os.getpid(),
            instance_id=self.instance_id,
            model_id=self.model_id,
            model_name=Path(self.checkpoint).name,
            layer_start=self.layers.start,
            layer_end=self.layers.end,
            num_layers=self.config.num_layers,
            dtype=dtype_to_wire(self.dtype),
            device=self.settings.device,
            tp_size=self.settings.tp,
            weights_bytes=self.weights_bytes,
            kv_blocks_total=engine.cache.blocks_total if engine else 0,
            kv_blocks_free=engine.cache.blocks_free if engine else 0,
            kv_block_size=self.settings.kv_block_size,
            in_flight_steps=self.servicer.in_flight if self.servicer else 0,
            active_sequences=len(engine.cache.sequences()) if engine else 0,
            state=self.state,
            steps_computed=engine.steps_computed if engine else 0,
            compute_seconds=engine.compute_seconds if engine else 0.0,
            orphan_ttl_seconds=self.settings.orphan_ttl,
            steps_run_ahead=guesses["used"],
            steps_run_ahead_dropped=guesses["dropped"],
        )

    async def serve(self, *, stop: asyncio.Event | None = None) -> None:
        """Load, listen, and serve until `stop` is set or SIGTERM/SIGINT arrives."""
        s = self.settings
        server = grpc.aio.server(
            options=server_options(s.max_message_bytes), maximum_concurrent_rpcs=s.max_concurrent_rpcs
        )
        add_servicer(server, self.health, health_pb2.DESCRIPTOR.services_by_name["Health"])
        proxy = _UntilLoaded()
        add_servicer(server, proxy, stage_pb2.DESCRIPTOR.services_by_name["StageWorker"])
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        tls = member_files(s.tls)
        credentials = tls.server_credentials(require_client_auth=True) if tls is not None else None
        port = listen_on(server, f"{s.host}:{s.port}", credentials)
        bound = f"{s.host}:{port}"
        self.address = s.advertise or bound
        await server.start()
        probes = await health_only_server(self.health, f"{s.host}:{s.health_port}") if s.health_port else None
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await loop.run_in_executor(self.compute_thread, self.load)
        await loop.run_in_executor(self.compute_thread, stay_in_inference_mode)  # as every step runs
        telemetry = Telemetry(s.telemetry, service=f"layerline-stage-{self.layers.start}-{self.layers.end}")
        self.member_credentials = tls.channel_credentials() if tls is not None else None
        hops = NextHops(max_message_bytes=s.max_message_bytes, credentials=self.member_credentials)
        self.servicer = self._servicer(hops, telemetry, tls=tls is not None)
        proxy.target = self.servicer
        orphans = Orphans(
            self.servicer.engine,
            on_compute_thread=self.servicer.on_compute_thread,
            ttl=s.orphan_ttl,
            telemetry=self.servicer.telemetry,
        )
        await self._open(bound, telemetry)
        membership = asyncio.create_task(self._membership(s.coordinator, orphans)) if s.coordinator else None
        sweeps = asyncio.create_task(orphans.sweep_forever())
        watch = asyncio.create_task(self._watch_ranks(stop)) if self.followers else None
        await stop.wait()
        # Draining: NOT_SERVING first, so no new sequence comes; then leave the coordinator, which
        # moves this stage's sequences to other chains by replay; then finish in-flight calls.
        log.info("draining: NOT_SERVING, waiting up to %.0fs for in-flight calls", s.grace_seconds)
        self.state = common_pb2.WORKER_STATE_DRAINING
        await self.health.enter_graceful_shutdown()
        sweeps.cancel()
        if membership is not None and s.coordinator is not None:
            membership.cancel()
            await self._deregister(s.coordinator, "draining (SIGTERM)")
        await server.stop(s.grace_seconds)
        if probes is not None:
            await probes.stop(0)
        await hops.close()
        if watch is not None:
            watch.cancel()
            if not self.failed:
                await self.servicer.on_compute_thread(self.engine.stop)  # type: ignore[union-attr]  # a LeadingEngine
            tp_group.stop_followers(self.followers, grace=s.grace_seconds)
        self.servicer.compute.shutdown(wait=False)
        telemetry.shutdown()  # exports the spans still buffered
        log.info("stopped")

    async def _open(self, bound: str, telemetry: Telemetry) -> None:
        """SERVING, and say where."""
        s = self.settings
        self.state = common_pb2.WORKER_STATE_SERVING
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("layerline.v1.StageWorker", health_pb2.HealthCheckResponse.SERVING)
        listening = bound if self.address == bound else f"{bound}, advertised as {self.address}"
        log.info("stage %s serving on %s (model id %s, pid %d)", self.layers, listening, self.model_id, os.getpid())
        if s.health_port:
            log.info("health alone, in plaintext, on %s:%d", s.host, s.health_port)
        log.info("telemetry: %s", telemetry.describe())

    def _servicer(self, hops: NextHops, telemetry: Telemetry, *, tls: bool) -> StageServicer:
        """The StageWorker service over the loaded engine."""
        s, engine = self.settings, self.engine
        assert engine is not None
        return StageServicer(
            engine,
            model_id=self.model_id,
            limits=StreamLimits(
                codec=CodecLimits(max_tensor_bytes=s.max_tensor_bytes),
                max_message_bytes=s.max_message_bytes,
                max_chunk_bytes=s.max_chunk_bytes,
                max_in_flight=s.max_in_flight,
                max_sequences=s.max_sequences,
            ),
            hops=hops,
            worker_info=self.info,
            telemetry=StageTelemetry.of(
                telemetry,
                layers=f"{self.layers.start}:{self.layers.end}",
                kv_blocks=lambda: (engine.cache.blocks_total - engine.cache.blocks_free, engine.cache.blocks_free),
            ),
            routes=self.routes,
            tls=tls,
            compute_thread=self.compute_thread,
        )

    async def _watch_ranks(self, stop: asyncio.Event) -> None:
        """Fail stop when a rank dies or hangs: NOT_SERVING, the other ranks killed, exit."""
        beat = 0.0
        while True:
            await asyncio.sleep(0.2)
            beat += 0.2
            reason = ""
            if gone := tp_group.gone(self.followers):
                reason = f"rank(s) {gone} exited"
            elif beat >= KEEPALIVE_SECONDS:
                beat = 0.0
                try:  # keeps idle ranks inside the collective timeout, and finds a hung one
                    await self.servicer.on_compute_thread(self.engine.keepalive)  # type: ignore[union-attr]
                except RankFailed as err:
                    reason = str(err)
            if reason:
                log.error("tensor-parallel stage fails stop: %s", reason)
                self.failed = True
                self.state = common_pb2.WORKER_STATE_NOT_SERVING
                await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                for p in self.followers:
                    if p.poll() is None:
                        p.kill()
                stop.set()
                return

    async def _membership(self, coordinator: str, orphans: Orphans) -> None:
        """Register with the coordinator and heartbeat; register again whenever it forgets us."""
        async with aio_channel(coordinator, credentials=self.member_credentials) as channel:
            stub = coordinator_pb2_grpc.RegistryStub(channel)
            interval, known = 1.0, False
            while True:
                try:
                    if not known:
                        held = await orphans.held()  # before registering: no step of this registration
                        reply = await stub.Register(coordinator_pb2.RegisterRequest(worker=self.info()), timeout=5)
                        interval = max(reply.heartbeat_interval_ms / 1000, 0.05)
                        self.routes.key = reply.route_key or None  # the routes this stage follows from now on
                        log.info("registered with coordinator %s", coordinator)
                        known = True
                        if not reply.known and held:
                            await orphans.free_unknown(held)
                    else:
                        beat = await stub.Heartbeat(coordinator_pb2.HeartbeatRequest(worker=self.info()), timeout=5)
                        known = beat.known
                except grpc.aio.AioRpcError as err:
                    if known:
                        log.warning("coordinator %s unreachable: %s", coordinator, err.code().name)
                    known = False
                    if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        log.error("coordinator %s refused this stage: %s", coordinator, err.details())
                await asyncio.sleep(interval)

    async def _deregister(self, coordinator: str, reason: str) -> None:
        async with aio_channel(coordinator, credentials=self.member_credentials) as channel:
            try:
                await coordinator_pb2_grpc.RegistryStub(channel).Deregister(
                    coordinator_pb2.DeregisterRequest(
                        address=self.address, instance_id=self.instance_id, reason=reason
                    ),
                    timeout=2,
                )
            except grpc.aio.AioRpcError as err:
                log.warning("could not deregister from %s: %s", coordinator, err.code().name)


class _UntilLoaded(stage_pb2_grpc.StageWorkerServicer):
    """Answers UNAVAILABLE while the weights load, then hands every call to the real servicer."""

    def __init__(self) -> None:
        self.target: StageServicer | None = None

    async def _loaded(self, context: grpc.aio.ServicerContext) -> StageServicer:
        if self.target is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "stage is still loading its weights")
        assert self.target is not None
        return self.target

    async def Step(self, request_iterator, context):
        target = await self._loaded(context)
        async for result in target.Step(request_iterator, context):
            yield result

    async def Results(self, request, context):
        target = await self._loaded(context)
        async for result in target.Results(request, context):
            yield result

    async def Release(self, request, context):
        return await (await self._loaded(context)).Release(request, context)

    async def Info(self, request, context):
        return await (await self._loaded(context)).Info(request, context)


def run_stage(settings: StageSettings) -> int:
    """Run a stage worker in this process until it is stopped; the process exit status."""
    worker = StageWorker(settings)
    asyncio.run(worker.serve())
    return 1 if worker.failed else 0


def run_follower(settings: StageSettings, *, rank: int, master: str) -> int:
    """Rank `rank` > 0 of a tensor-parallel stage: load its shards, then follow rank 0 until STOP."""
    tp_group.die_with_parent()
    worker = StageWorker(settings)  # sets the thread count
    tp = tp_group.join_group(
        rank=rank, size=settings.tp, master=master, timeout_s=settings.tp_timeout, device=settings.device
    )
    engine = worker.build_engine(tp)
    stay_in_inference_mode()  # this thread runs the rank's steps from now on, as rank 0's compute thread
    try:
        follow(engine, tp.group)
    except RankFailed as err:
        log.error("rank %d fails stop: %s", rank, err)
        return 1
    return 0


__all__ = ["StageSettings", "StageWorker", "run_follower", "run_stage"]
