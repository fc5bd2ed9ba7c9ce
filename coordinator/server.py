"""The coordinator process: the gRPC server, the maintenance loop, clean stop.

Owns wiring the registry, cluster, services and telemetry together, the
standard health service, and the process lifecycle (SIGTERM: stop admitting, finish in-flight
requests, export the spans still buffered, exit 0). Never imports torch.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from layerline.model_store import resolve_model
from layerline.protos.v1 import coordinator_pb2_grpc
from layerline.shared.model_config import ModelConfig
from layerline.shared.rpc import listen, server_options
from layerline.shared.telemetry import Telemetry

from .cluster import Cluster
from .registry import Registry
from .servicer import Admission, CoordinatorServicer, RegistryServicer
from .settings import CoordinatorSettings
from .telemetry import CoordinatorTelemetry
from .text import TextModel

log = logging.getLogger("layerline.coordinator")


async def serve(settings: CoordinatorSettings, *, stop: asyncio.Event | None = None) -> None:
    checkpoint = resolve_model(settings.model)
    config = ModelConfig.from_checkpoint(checkpoint)
    text = TextModel.from_checkpoint(checkpoint)
    registry = Registry(num_layers=config.num_layers, expiry=settings.heartbeat_expiry)
    telemetry = Telemetry(settings.telemetry, service="layerline-coordinator")
    cluster = Cluster(
        registry,
        max_message_bytes=settings.max_message_bytes,
        token_budget=settings.token_budget,
        share_prefixes=settings.share_prefixes,
        prefix_cache=settings.prefix_cache,
        depth=settings.depth,
        tracer=telemetry.tracer,
    )
    server = grpc.aio.server(options=server_options(settings.max_message_bytes))
    admission = Admission(
        max_active=settings.max_active,
        max_queued=settings.max_queued,
        rate_limit=settings.rate_limit,
        default_max_tokens=settings.default_max_tokens,
        max_context=config.max_position_embeddings,
    )
    observed = CoordinatorTelemetry(telemetry, model_name=Path(checkpoint).name)
    servicer = CoordinatorServicer(
        cluster, text, admission=admission, model_name=Path(checkpoint).name, telemetry=observed
    )
    observed.watch(
        running=lambda: servicer.active, waiting=lambda: servicer.queued, failovers=lambda: cluster.failovers
    )
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
    coordinator_pb2_grpc.add_RegistryServicer_to_server(
        RegistryServicer(cluster, heartbeat_interval=settings.heartbeat_interval), server
    )
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]  # not in grpc-stubs
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = listen(server, f"{settings.host}:{settings.port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "coordinator for %s (%d layers) serving on %s:%d",
        Path(checkpoint).name,
        registry.num_layers,
        settings.host,
        port,
    )
    log.info("telemetry: %s", telemetry.describe())
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    maintenance = [
        asyncio.create_task(_maintain(cluster)),
        asyncio.create_task(_probe(cluster, every=settings.probe_interval)),
    ]
    await stop.wait()
    log.info("stopping: no new requests; waiting up to %.0fs for %d in-flight", settings.grace_seconds, servicer.active)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(settings.grace_seconds)
    for task in maintenance:
        task.cancel()
    await cluster.close()
    telemetry.shutdown()  # exports the spans still buffered
    log.info("stopped")


async def _maintain(cluster: Cluster) -> None:
    """Expire silent workers and rebuild chains; never waits on a worker."""
    while True:
        cluster.refresh()
        await asyncio.sleep(0.25)


async def _probe(cluster: Cluster, *, every: float) -> None:
    """Readiness probes, apart from `_maintain` so that a hung worker cannot delay it."""
    while True:
        await cluster.probe_workers(every=every)
        await asyncio.sleep(0.25)


def run_coordinator(settings: CoordinatorSettings) -> int:
    asyncio.run(serve(settings))
    return 0


__all__ = ["CoordinatorSettings", "run_coordinator", "serve"]
