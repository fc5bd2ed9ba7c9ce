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
from grpc_health.v1 import health, health_pb2
from prometheus_client import generate_latest

from layerline.model_store import resolve_model
from layerline.protos.v1 import coordinator_pb2
from layerline.shared.model_config import ModelConfig
from layerline.shared.routes import new_key
from layerline.shared.rpc import listen_on, server_options
from layerline.shared.services import add_servicer, health_only_server
from layerline.shared.telemetry import Telemetry
from layerline.shared.tls import TLSFiles, member_files, server_credentials

from .auth import TokenInterceptor, Tokens
from .chain import MemberLinks
from .cluster import Cluster
from .http_api import HttpApi, HttpServer
from .members import RegistryServicer
from .registry import Registry
from .requests import Admission
from .servicer import CoordinatorServicer
from .serving import Serving
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
    tls = member_files(settings.tls)
    links = MemberLinks(route_key=new_key(), credentials=tls.channel_credentials() if tls is not None else None)
    tokens = Tokens.load(settings.api_tokens, settings.admin_tokens)
    cluster = Cluster(
        registry,
        max_message_bytes=settings.max_message_bytes,
        token_budget=settings.token_budget,
        share_prefixes=settings.share_prefixes,
        prefix_cache=settings.prefix_cache,
        depth=settings.depth,
        routing=settings.routing,
        links=links,
        tracer=telemetry.tracer,
    )
    # A client's request is a prompt or a chat: gRPC parses it before any check, so its port takes
    # no more than room for the largest allowed (the members' messages stay at the shared limit).
    client_message_bytes = min(settings.max_message_bytes, 2 * settings.max_prompt_bytes + (256 << 10))
    server = grpc.aio.server(
        options=server_options(client_message_bytes),
        interceptors=[TokenInterceptor(tokens)],
        maximum_concurrent_rpcs=settings.max_concurrent_rpcs,
    )
    members = grpc.aio.server(options=server_options(), maximum_concurrent_rpcs=settings.max_concurrent_rpcs)
    serving = _serving(settings, cluster, text, telemetry, model_name=Path(checkpoint).name, context=config)
    servicer = CoordinatorServicer(serving)
    add_servicer(server, servicer, coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"])
    registry_servicer = RegistryServicer(
        cluster, heartbeat_interval=settings.heartbeat_interval, route_key=links.route_key, tls=tls is not None
    )
    add_servicer(members, registry_servicer, coordinator_pb2.DESCRIPTOR.services_by_name["Registry"])
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]  # not in grpc-stubs
    for each in (server, members):
        add_servicer(each, health_servicer, health_pb2.DESCRIPTOR.services_by_name["Health"])
    client_credentials = server_credentials(tls.cert, tls.key) if tls is not None else None
    port = listen_on(server, f"{settings.host}:{settings.port}", client_credentials)
    cluster_port = listen_on(
        members,
        f"{settings.host}:{settings.cluster_port}",
        tls.server_credentials(require_client_auth=True) if tls is not None else None,
    )
    await server.start()
    probes = (
        await health_only_server(health_servicer, f"{settings.host}:{settings.health_port}")
        if settings.health_port
        else None
    )
    await members.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    guards = ["TLS"] * bool(tls) + ["bearer tokens"] * tokens.required
    log.info(
        "coordinator for %s (%d layers) serving clients on %s:%d (%s), stage workers on %s:%d (%s)",
        Path(checkpoint).name,
        registry.num_layers,
        settings.host,
        port,
        ", ".join(guards) or "open: plaintext, no token",
        settings.host,
        cluster_port,
        "mutual TLS" if tls else "plaintext",
    )
    if probes is not None:
        log.info("health alone, in plaintext, on %s:%d", settings.host, settings.health_port)
    http = None
    if settings.http_port is not None:
        http = _http_api(serving, settings, tokens=tokens, tls=tls, telemetry=telemetry, body=client_message_bytes)
        await http.start()
        scheme = "https" if http.tls else "http"
        log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", scheme, settings.host, http.port)
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
    log.info("stopping: no new requests; waiting up to %.0fs for %d in-flight", settings.grace_seconds, serving.active)
    await health_servicer.enter_graceful_shutdown()
    await _stop_servers(http, server, members, probes, grace=settings.grace_seconds)
    for task in maintenance:
        task.cancel()
    await cluster.close()
    serving.close()
    telemetry.shutdown()  # exports the spans still buffered
    log.info("stopped")


async def _stop_servers(
    http: HttpServer | None,
    clients: grpc.aio.Server,
    members: grpc.aio.Server,
    probes: grpc.aio.Server | None,
    *,
    grace: float,
) -> None:
    """Stop taking requests, give those in progress `grace` seconds, then close the members' ports."""
    await asyncio.gather(clients.stop(grace), *([http.stop()] if http is not None else []))
    await members.stop(1.0)
    if probes is not None:
        await probes.stop(0)


def _serving(
    settings: CoordinatorSettings,
    cluster: Cluster,
    text: TextModel,
    telemetry: Telemetry,
    *,
    model_name: str,
    context: ModelConfig,
) -> Serving:
    """The one generation path of every API, under the settings' admission, its gauges watched."""
    admission = Admission(
        max_active=settings.max_active,
        max_queued=settings.max_queued,
        rate_limit=settings.rate_limit,
        default_max_tokens=settings.default_max_tokens,
        max_context=context.max_position_embeddings,
        max_prompt_bytes=settings.max_prompt_bytes,
        max_prompt_tokens=settings.max_prompt_tokens,
        max_chat_messages=settings.max_chat_messages,
    )
    observed = CoordinatorTelemetry(telemetry, model_name=model_name)
    serving = Serving(
        cluster, text, admission=admission, model_name=model_name, telemetry=observed, speculate=settings.speculate
    )
    observed.watch(
        running=lambda: serving.active,
        waiting=lambda: serving.queued,
        failovers=lambda: cluster.failovers,
        preemptions=lambda: cluster.preemptions,
        stalls=lambda: cluster.stalls,
        prefix_queries=lambda: cluster.prefix_queries,
        prefix_hits=lambda: cluster.shared_prefix_tokens,
        draft_tokens=lambda: cluster.draft_tokens,
        accepted_tokens=lambda: cluster.accepted_tokens,
    )
    return serving


def _http_api(
    serving: Serving,
    settings: CoordinatorSettings,
    *,
    tokens: Tokens,
    tls: TLSFiles | None,
    telemetry: Telemetry,
    body: int,
) -> HttpServer:
    """The OpenAI-compatible HTTP API on --http-port, with the client port's certificate and tokens."""
    registry = telemetry.metrics_registry
    metrics = (lambda: generate_latest(registry)) if registry is not None else None
    api = HttpApi(serving, tokens=tokens, max_body_bytes=body, metrics=metrics)
    port, grace = settings.http_port or 0, settings.grace_seconds
    if tls is None:
        return HttpServer(api, settings.host, port, grace=grace)
    return HttpServer(api, settings.host, port, grace=grace, certfile=str(tls.cert), keyfile=str(tls.key))


async def _maintain(cluster: Cluster) -> None:
    """Expire silent workers and rebuild chains; never waits on a worker. A failure is logged and
    the loop goes on: a loop that died would leave the cluster without maintenance."""
    while True:
        try:
            cluster.refresh()
        except Exception:
            log.exception("maintenance round failed")
        await asyncio.sleep(0.25)


async def _probe(cluster: Cluster, *, every: float) -> None:
    """Readiness probes, apart from `_maintain`: each due worker's runs on its own, so a hung
    worker's delays nothing else; a failed round is logged and the loop goes on."""
    while True:
        try:
            cluster.probe_workers(every=every)
        except Exception:
            log.exception("probe round failed")
        await asyncio.sleep(0.25)


def run_coordinator(settings: CoordinatorSettings) -> int:
    asyncio.run(serve(settings))
    return 0


__all__ = ["CoordinatorSettings", "run_coordinator", "serve"]
