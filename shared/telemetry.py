"""Traces and metrics setup shared by the coordinator and the stage workers.

Owns turning a process's telemetry settings (`--trace`, `--otlp-endpoint`, `--metrics-port`)
into OpenTelemetry providers: a TracerProvider that batches spans to an OTLP/gRPC collector or
to the console, and a MeterProvider read by a Prometheus scrape endpoint served with
prometheus_client; and their clean shutdown, which flushes the spans still buffered.

Tracing is off by default. Off means no TracerProvider at all: `Telemetry.tracer` is None, and
callers check that once per request or step and then build neither spans nor carriers. Metrics
are off unless a port is given (`Telemetry.meter` is None). Trace context crosses processes only
through OpenTelemetry's global propagators (`opentelemetry.propagate`, W3C trace context unless
OTEL_PROPAGATORS says otherwise), never as hand-built strings.

Knows nothing of requests, steps or tensors: `coordinator.telemetry` and
`stage_worker.step_telemetry` own what is measured. Never imports torch.
"""

from __future__ import annotations

import sys
from typing import TextIO
from wsgiref.simple_server import WSGIServer

from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import Tracer
from prometheus_client import CollectorRegistry

from .settings import TelemetrySettings, collector_url

__all__ = ["BYTES_BUCKETS", "SCOPE", "SECONDS_BUCKETS", "Telemetry", "TelemetrySettings"]

SCOPE = "layerline"  # the instrumentation scope of every span and instrument

# Histogram buckets: seconds from 0.5 ms to 80 s, bytes from 256 B to 1 GiB.
# fmt: off
SECONDS_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
    10.0, 20.0, 40.0, 80.0,
)
# fmt: on
BYTES_BUCKETS = tuple(float(256 * 4**i) for i in range(12))


class Telemetry:
    """One process's tracer and meter (each None when off) and what must be stopped at exit."""

    def __init__(self, settings: TelemetrySettings, *, service: str, console: TextIO | None = None) -> None:
        """Start exporting as `settings` say, for the OpenTelemetry service name `service`.

        `console` is where `--trace console` writes (default: stdout). Raises OSError when the
        metrics port cannot be bound.
        """
        self.settings = settings
        self.tracer: Tracer | None = None
        self.meter: Meter | None = None
        self.metrics_registry: CollectorRegistry | None = None  # what the scrape endpoint serves, when on
        self._tracer_provider: TracerProvider | None = None
        self._meter_provider: MeterProvider | None = None
        self._metrics_server: WSGIServer | None = None
        if settings.trace == "off" and not settings.metrics_port:
            return
        resource = Resource.create({SERVICE_NAME: service})
        if settings.trace != "off":
            self._start_tracing(resource, console or sys.stdout)
        if settings.metrics_port:
            self._start_metrics(resource)

    def _start_tracing(self, resource: Resource, console: TextIO) -> None:
        exporter: SpanExporter
        if self.settings.trace == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            endpoint = self.settings.otlp_endpoint
            exporter = OTLPSpanExporter(endpoint=collector_url(endpoint) if endpoint else None)
        else:
            exporter = ConsoleSpanExporter(out=console, formatter=lambda span: span.to_json(indent=None) + "\n")
        # The sampler comes from OTEL_TRACES_SAMPLER (default: parent-based, always on), the
        # batching from OTEL_BSP_*; spans are exported from the processor's own thread.
        self._tracer_provider = TracerProvider(resource=resource)
        self._tracer_provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self._tracer_provider.get_tracer(SCOPE)

    def _start_metrics(self, resource: Resource) -> None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import ProcessCollector, start_http_server

        registry = CollectorRegistry()
        ProcessCollector(registry=registry)  # process_cpu_seconds_total, resident memory, ...
        reader = PrometheusMetricReader(registry=registry)
        self._meter_provider = MeterProvider(metric_readers=[reader], resource=resource)
        self.meter = self._meter_provider.get_meter(SCOPE)
        self.metrics_registry = registry
        self._metrics_server, _ = start_http_server(
            self.settings.metrics_port, addr=self.settings.metrics_host, registry=registry
        )

    def describe(self) -> str:
        """Where traces and metrics go, for the process's log."""
        s = self.settings
        traces = {
            "off": "off",
            "console": "to stdout (JSON lines)",
            "otlp": f"OTLP/gRPC to {s.otlp_endpoint or 'the OTEL_EXPORTER_OTLP_* endpoint'}",
        }[s.trace]
        metrics = f"http://{s.metrics_host}:{s.metrics_port}/metrics" if s.metrics_port else "off"
        return f"traces {traces}; metrics {metrics}"

    def shutdown(self) -> None:
        """Flush and export the spans still buffered, stop the scrape endpoint."""
        if self._tracer_provider is not None:
            self._tracer_provider.shutdown()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        if self._meter_provider is not None:
            self._meter_provider.shutdown()
