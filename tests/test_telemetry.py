"""OpenTelemetry traces and Prometheus metrics of a real 2-stage cluster of a tiny model.

One cluster traces to an OTLP/gRPC receiver that this test runs (the collector's TraceService)
and serves metrics from every process. Its workload runs once, in a fixture: a request made
under the test's own span (the SDK sends that context), a chat, three concurrent requests, and
one that the coordinator refuses; then every process's metrics are scraped and the cluster is stopped with
SIGTERM, which exports every span still buffered. The tests read what arrived. A second cluster
runs with tracing off while the OTLP environment points at a receiver: nothing may arrive.
The rest runs in this process: the console exporter, the flags, the bubble clock, step spans.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import grpc
import pytest
from opentelemetry import propagate
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2 as otlp_common_pb2
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, StatusCode, get_current_span, set_span_in_context
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from layerline.cli import main
from layerline.client import AsyncClient, Client, Completion, InvalidArgument
from layerline.coordinator.scheduler import Outcome, PlannedStep, Sequence, Slice, StepFailed
from layerline.coordinator.telemetry import StepSpans
from layerline.launcher import ClusterPlan, LocalCluster
from layerline.shared.sampling import SamplingParams
from layerline.shared.telemetry import Telemetry, TelemetrySettings
from layerline.stage_worker.busy_clock import BusyClock

from .stage_client import free_port, free_ports
from .tiny_models import make_tiny_checkpoint, write_byte_tokenizer

PROMPTS = ["Once upon a time", "The three primary colors are", "def fibonacci(n):", "Water boils at"]
SERVICES = {"layerline-coordinator", "layerline-stage-0-2", "layerline-stage-2-4"}
SERVER, CLIENT = 2, 3  # OTLP span kinds
STATUS_ERROR = 2


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    kind: int
    start: int  # ns since the epoch
    end: int
    attributes: dict[str, object]
    status_code: int
    status_message: str


def _value(v: otlp_common_pb2.AnyValue) -> object:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which)


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """The collector's OTLP/gRPC TraceService on 127.0.0.1: keeps every export request."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def Export(self, request, context):  # type: ignore[no-untyped-def]
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[ReceivedSpan]:
        out = []
        for request in self.requests:
            for rs in request.resource_spans:
                resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.append(
                            ReceivedSpan(
                                service=str(resource["service.name"]),
                                name=s.name,
                                trace_id=s.trace_id.hex(),
                                span_id=s.span_id.hex(),
                                parent_id=s.parent_span_id.hex(),
                                kind=s.kind,
                                start=s.start_time_unix_nano,
                                end=s.end_time_unix_nano,
                                attributes={a.key: _value(a.value) for a in s.attributes},
                                status_code=s.status.code,
                                status_message=s.status.message,
                            )
                        )
        return out

    def stop(self) -> None:
        self._server.stop(None)


def scrape(port: int) -> dict[str, Metric]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {family.name: family for family in text_string_to_metric_families(text)}


def scrape_when_idle(ports: dict[str, int], *, timeout: float = 60.0) -> dict[str, dict[str, Metric]]:
    """Every process's metrics once the cluster is idle: the coordinator runs no request and no
    stage has computed a step since the scrape before, 0.2 s earlier (a decode step planned as a
    request finished may still be running when the client has its answer). The stages' KV is
    no sign: the prefix cache keeps finished requests' KV on them."""
    deadline = time.monotonic() + timeout
    before: list[float] | None = None
    while True:
        metrics = {name: scrape(port) for name, port in ports.items()}
        steps = [
            sum(s.value for s in families["layerline_stage_step_seconds"].samples if s.name.endswith("_count"))
            for name, families in sorted(metrics.items())
            if name.startswith("stage")
        ]
        running = value(metrics["coordinator"], "layerline_num_requests_running")
        if (running == 0 and steps == before) or time.monotonic() > deadline:
            return metrics
        before = steps
        time.sleep(0.2)


def value(families: dict[str, Metric], family: str, sample: str | None = None, **labels: str) -> float:
    """The sum of a family's samples named `sample` (default: the family) whose labels include `labels`."""
    name = sample or family
    found = [
        s.value
        for s in families[family].samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert found, (name, labels, families[family].samples)
    return sum(found)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random SmolLM2-shaped model of 4 layers, with a byte-level tokenizer."""
    path = tmp_path_factory.mktemp("tiny-serving")
    make_tiny_checkpoint("smollm2", path, num_layers=4, vocab_size=259)
    assert write_byte_tokenizer(path) == 259
    return path


@dataclass
class TracedRun:
    caller: SpanContext  # the test's own span, around the first request
    traced: Completion  # the request made under it
    chat: Completion
    concurrent: list[Completion]
    spans: list[ReceivedSpan]
    exports: list[trace_service_pb2.ExportTraceServiceRequest]
    metrics: dict[str, dict[str, Metric]]  # process name -> its scraped families
    stage_addresses: dict[str, str]  # "0:2" -> address
    exit_codes: list[int | None]


@pytest.fixture(scope="module")
def traced(checkpoint, tmp_path_factory) -> Iterator[TracedRun]:
    receiver = OtlpReceiver()
    plan = ClusterPlan(
        model=str(checkpoint),
        layer_ranges=((0, 2), (2, 4)),
        port=free_port(),
        log_dir=tmp_path_factory.mktemp("traced-logs"),
        kv_memory="4M",
        threads=1,
        trace="otlp",
        otlp_endpoint=f"127.0.0.1:{receiver.port}",
        metrics_port=free_ports(3),
    )
    cluster = LocalCluster(plan, checkpoint)
    cluster.start()
    try:
        status = cluster.wait_ready(timeout=180)
        tracer = TracerProvider().get_tracer("test")
        with Client(cluster.address) as client:
            with tracer.start_as_current_span("caller") as caller:
                first = client.generate(PROMPTS[0], max_tokens=4, temperature=0.0)
            with pytest.raises(InvalidArgument, match="exceeds the context length"):
                client.generate(PROMPTS[0], max_tokens=300, temperature=0.0)
            chat = client.chat([{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0.0)

        async def concurrently() -> list[Completion]:
            async with AsyncClient(cluster.address) as aclient:
                return await asyncio.gather(*(aclient.generate(p, max_tokens=5, temperature=0.0) for p in PROMPTS[1:]))

        rest = asyncio.run(concurrently())
        metrics = scrape_when_idle(cluster.metrics_ports)
    finally:
        cluster.stop()
    receiver.stop()
    yield TracedRun(
        caller=caller.get_span_context(),
        traced=first,
        chat=chat,
        concurrent=rest,
        spans=receiver.spans(),
        exports=receiver.requests,
        metrics=metrics,
        stage_addresses={f"{w.layers[0]}:{w.layers[1]}": w.address for w in status.workers},
        exit_codes=[p.returncode for _, p in cluster.procs],
    )


def _trace_of(run: TracedRun, request_span: ReceivedSpan) -> dict[str, list[ReceivedSpan]]:
    """The spans of one request's trace by name: its steps and its hops on each stage."""
    in_trace = [s for s in run.spans if s.trace_id == request_span.trace_id]
    by_name: dict[str, list[ReceivedSpan]] = {}
    for s in in_trace:
        by_name.setdefault(s.name, []).append(s)
    return by_name


def _request_spans(run: TracedRun) -> list[ReceivedSpan]:
    return [s for s in run.spans if s.name.startswith("text_completion ")]


def _check_request_trace(run: TracedRun, request: ReceivedSpan, completion: Completion) -> None:
    """Every step of the request, and its hop on each stage, with parents across processes."""
    spans = _trace_of(run, request)
    steps, first, last = spans["step"], spans["stage 0:2"], spans["stage 2:4"]
    assert set(spans) == {request.name, "step", "stage 0:2", "stage 2:4"}
    # One step per generated token (the prompt's step samples the first), each seen on both hops;
    # none after the token that finishes the request.
    assert len(steps) == len(first) == len(last) == completion.usage.completion_tokens
    assert {s.service for s in steps} == {"layerline-coordinator"}
    assert {s.service for s in first} == {"layerline-stage-0-2"}
    assert {s.service for s in last} == {"layerline-stage-2-4"}
    by_id = {s.span_id: s for s in spans[request.name] + steps + first + last}
    for step in steps:
        assert step.parent_id == request.span_id and step.kind == CLIENT
    for hop in first:
        assert by_id[hop.parent_id].name == "step" and hop.kind == SERVER
    for hop in last:
        assert by_id[hop.parent_id].name == "stage 0:2" and hop.kind == SERVER
    # What causality orders across the processes: each hop starts after its parent, and the last
    # stage's ends (its result queued for the coordinator) before the step does. The first
    # stage's ends when its write to the next hop completes, which nothing orders against the
    # step's end: on a busy machine the coordinator may have the result first.
    for hop in first + last:
        parent = by_id[hop.parent_id]
        step = parent if hop in first else by_id[parent.parent_id]
        assert step.start <= parent.start <= hop.start <= hop.end
        if hop in last:
            assert hop.end <= step.end
    tokens = [s.attributes["layerline.sequence.tokens"] for s in sorted(steps, key=lambda s: s.start)]
    assert tokens == [completion.usage.prompt_tokens] + [1] * (len(steps) - 1)


@pytest.mark.cluster
def test_one_request_is_one_trace_over_the_coordinator_and_both_stages(traced):
    caller_trace = f"{traced.caller.trace_id:032x}"
    (request,) = [s for s in _request_spans(traced) if s.trace_id == caller_trace]
    # The SDK sent the caller's context: the request span is the child of the test's own span.
    assert request.parent_id == f"{traced.caller.span_id:016x}"
    assert request.service == "layerline-coordinator" and request.kind == SERVER
    assert {s.service for s in traced.spans if s.trace_id == caller_trace} == SERVICES
    _check_request_trace(traced, request, traced.traced)


@pytest.mark.cluster
def test_concurrent_requests_each_get_their_own_view_of_every_hop(traced):
    requests = [
        s
        for s in _request_spans(traced)
        if s.attributes["gen_ai.usage.input_tokens"] > 0 and s.status_code != STATUS_ERROR and s.parent_id == ""
    ]
    assert len(requests) == len(traced.concurrent)
    by_prompt = {len(PROMPTS[i + 1].encode()): c for i, c in enumerate(traced.concurrent)}
    for request in requests:
        _check_request_trace(traced, request, by_prompt[request.attributes["gen_ai.usage.input_tokens"]])
    assert len({r.trace_id for r in requests}) == len(requests)


@pytest.mark.cluster
def test_the_request_span_carries_gen_ai_attributes_and_latencies(traced):
    caller_trace = f"{traced.caller.trace_id:032x}"
    (request,) = [s for s in _request_spans(traced) if s.trace_id == caller_trace]
    a = request.attributes
    assert request.name == f"text_completion {Path(str(a['gen_ai.request.model'])).name}"
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.usage.input_tokens"] == traced.traced.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == traced.traced.usage.completion_tokens
    assert a["gen_ai.response.finish_reasons"] == [traced.traced.finish_reason]
    assert a["gen_ai.request.max_tokens"] == 4 and a["gen_ai.request.temperature"] == 0.0
    assert a["layerline.request.failovers"] == 0
    queue, ttft = a["layerline.request.queue_seconds"], a["layerline.request.time_to_first_token_seconds"]
    assert 0 <= queue <= ttft <= a["layerline.request.e2e_seconds"]
    assert a["gen_ai.response.time_to_first_chunk"] == ttft


@pytest.mark.cluster
def test_step_spans_carry_each_hops_figures(traced):
    stages = [s for s in traced.spans if s.name.startswith("stage ")]
    assert stages
    for span in stages:
        a = span.attributes
        assert a["layerline.stage.layers"] == span.name.removeprefix("stage ")
        assert a["layerline.step.sequences"] >= 1 and a["layerline.step.tokens"] >= a["layerline.sequence.tokens"] >= 1
        assert a["layerline.step.compute_seconds"] > 0 and a["layerline.step.queue_seconds"] >= 0
        assert a["layerline.step.bytes_received"] > 0
        assert a["layerline.step.receive_seconds"] >= 0 and a["layerline.step.deserialize_seconds"] >= 0
        if span.name == "stage 0:2":  # it forwards hidden states to the last stage
            assert a["layerline.next_hop"] == traced.stage_addresses["2:4"]
            assert a["layerline.step.bytes_sent"] > a["layerline.sequence.tokens"] * 48 * 4  # float32 rows
            assert a["layerline.step.serialize_seconds"] > 0 and a["layerline.step.send_seconds"] >= 0
            assert a["layerline.step.deserialize_seconds"] == 0  # the first stage receives token ids only
        else:  # the last stage samples and answers; it decoded the hidden states it got
            assert "layerline.step.bytes_sent" not in a and "layerline.next_hop" not in a
            assert a["layerline.step.deserialize_seconds"] > 0
    steps = [s for s in traced.spans if s.name == "step"]
    assert {s.attributes["layerline.chain"] for s in steps} == {
        f"{traced.stage_addresses['0:2']} -> {traced.stage_addresses['2:4']}"
    }


@pytest.mark.cluster
def test_a_chat_is_a_chat_span_with_its_own_trace(traced):
    (chat,) = [s for s in traced.spans if s.name.startswith("chat ")]
    assert chat.attributes["gen_ai.operation.name"] == "chat"
    assert chat.attributes["gen_ai.usage.input_tokens"] == traced.chat.usage.prompt_tokens
    _check_request_trace(traced, chat, traced.chat)


@pytest.mark.cluster
def test_a_refused_request_has_an_error_span(traced):
    (refused,) = [s for s in _request_spans(traced) if s.status_code == STATUS_ERROR]
    assert refused.attributes["error.type"] == "INVALID_ARGUMENT"
    assert "exceeds the context length" in refused.status_message
    assert refused.attributes["gen_ai.response.finish_reasons"] == ["error"]
    assert not [s for s in traced.spans if s.trace_id == refused.trace_id and s.span_id != refused.span_id]


@pytest.mark.cluster
def test_otlp_exports_from_every_process_reach_the_receiver_and_decode(traced):
    services = Counter()
    for request in traced.exports:
        for rs in request.resource_spans:
            names = {a.key: _value(a.value) for a in rs.resource.attributes}
            services[names["service.name"]] += sum(len(ss.spans) for ss in rs.scope_spans)
    assert set(services) == SERVICES and all(services.values())
    for span in traced.spans:
        assert len(span.trace_id) == 32 and len(span.span_id) == 16 and span.start <= span.end
    assert traced.exit_codes == [0, 0, 0]


@pytest.mark.cluster
def test_prometheus_histograms_count_the_requests_that_were_made(traced):
    done = [traced.traced, traced.chat, *traced.concurrent]
    coordinator = traced.metrics["coordinator"]
    for histogram in (
        "layerline_time_to_first_token_seconds",
        "layerline_e2e_request_latency_seconds",
        "layerline_request_queue_time_seconds",
    ):
        assert value(coordinator, histogram, f"{histogram}_count") == len(done), histogram
    itl = "layerline_inter_token_latency_seconds"
    assert value(coordinator, itl, f"{itl}_count") == sum(c.usage.completion_tokens - 1 for c in done)
    finished = Counter(c.finish_reason for c in done)
    for reason, n in finished.items():
        assert value(coordinator, "layerline_requests", "layerline_requests_total", finish_reason=reason) == n
    assert value(coordinator, "layerline_requests", "layerline_requests_total", finish_reason="error") == 1
    assert value(coordinator, "layerline_generation_tokens", "layerline_generation_tokens_total") == sum(
        c.usage.completion_tokens for c in done
    )
    assert value(coordinator, "layerline_failovers", "layerline_failovers_total") == 0
    assert value(coordinator, "layerline_num_preemptions", "layerline_num_preemptions_total") == 0
    assert value(coordinator, "layerline_chain_stalls", "layerline_chain_stalls_total") == 0
    for spec in ("layerline_spec_decode_num_draft_tokens", "layerline_spec_decode_num_accepted_tokens"):
        assert value(coordinator, spec, f"{spec}_total") == 0  # --speculate is off
    assert value(coordinator, "layerline_num_requests_waiting") == 0
    assert "layerline_num_requests_running" in coordinator


@pytest.mark.cluster
def test_prometheus_stage_metrics_count_steps_bytes_and_kv_blocks(traced):
    first, last = traced.metrics["stage-r0-0-2"], traced.metrics["stage-r0-2-4"]
    step = "layerline_stage_step_seconds"
    steps = value(first, step, f"{step}_count", layers="0:2")
    # Every step runs on both stages; the traced request alone took one step per token.
    assert steps == value(last, step, f"{step}_count", layers="2:4") >= traced.traced.usage.completion_tokens
    hop = "layerline_hop_bytes"
    sent = value(first, hop, f"{hop}_sum", direction="sent", peer=traced.stage_addresses["2:4"])
    assert sent == value(last, hop, f"{hop}_sum", direction="received") > 0  # the same bytes, both ends
    assert value(first, hop, f"{hop}_count", direction="sent") == steps
    transfer = "layerline_hop_transfer_seconds"
    assert value(first, transfer, f"{transfer}_count", peer=traced.stage_addresses["2:4"]) == steps
    for families, layers in ((first, "0:2"), (last, "2:4")):
        assert value(families, "layerline_kv_blocks_free", layers=layers) > 0
        assert value(families, "layerline_kv_blocks_used", layers=layers) >= 0
        assert 0 <= value(families, "layerline_pipeline_bubble_fraction", layers=layers) <= 1
        active = value(families, "layerline_stage_active_seconds", "layerline_stage_active_seconds_total")
        assert (
            0 < active
            and 0 <= value(families, "layerline_stage_bubble_seconds", "layerline_stage_bubble_seconds_total") <= active
        )


@pytest.mark.cluster
def test_with_tracing_off_no_span_is_created(checkpoint, tmp_path):
    """The OTLP environment points at a receiver, a caller sends its context: still no span."""
    receiver = OtlpReceiver()
    environment = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
    }
    plan = ClusterPlan(
        model=str(checkpoint),
        layer_ranges=((0, 2), (2, 4)),
        port=free_port(),
        log_dir=tmp_path,
        kv_memory="4M",
        threads=1,
    )
    cluster = LocalCluster(plan, checkpoint)
    with mock.patch.dict(os.environ, environment):
        cluster.start()
    try:
        cluster.wait_ready(timeout=180)
        with Client(cluster.address) as client, TracerProvider().get_tracer("test").start_as_current_span("caller"):
            assert client.generate(PROMPTS[0], max_tokens=3, temperature=0.0).usage.completion_tokens >= 1
    finally:
        cluster.stop()
    receiver.stop()
    assert [p.returncode for _, p in cluster.procs] == [0, 0, 0]
    assert receiver.requests == []
    assert cluster.metrics_ports == {}
    assert "telemetry: traces off; metrics off" in (tmp_path / "coordinator.log").read_text()


def test_console_export_writes_one_json_line_per_span():
    out = io.StringIO()
    telemetry = Telemetry(TelemetrySettings(trace="console"), service="layerline-test", console=out)
    assert telemetry.meter is None
    with telemetry.tracer.start_as_current_span("outer"):
        with telemetry.tracer.start_as_current_span("inner"):
            pass
    telemetry.shutdown()
    spans = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [s["name"] for s in spans] == ["inner", "outer"]
    assert spans[0]["parent_id"] == spans[1]["context"]["span_id"]
    assert {s["resource"]["attributes"]["service.name"] for s in spans} == {"layerline-test"}


def test_telemetry_off_builds_no_tracer_and_no_meter():
    telemetry = Telemetry(TelemetrySettings(), service="layerline-test")
    assert (telemetry.tracer, telemetry.meter) == (None, None)
    telemetry.shutdown()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--trace", "otlp", "--otlp-endpoint", "collector"], "--otlp-endpoint 'collector' is not HOST:PORT"),
        (["--otlp-endpoint", "127.0.0.1:4317"], "--otlp-endpoint is given but --trace is off"),
        (["--metrics-port", "70000"], "--metrics-port 70000 must be in [0, 65535]"),
    ],
)
def test_bad_telemetry_flags_are_clear_errors(args, message, capsys):
    assert main(["coordinator", *args]) == 2
    assert message in capsys.readouterr().err


def test_bubble_fraction_is_the_idle_share_of_the_time_with_live_sequences():
    now = [0.0]
    clock = BusyClock(clock=lambda: now[0])
    now[0] = 5.0  # nothing held yet: neither active nor bubble
    clock.set(busy=True, active=True)
    now[0] = 7.0
    clock.set(busy=False, active=True)
    now[0] = 10.0  # 3 s idle with sequences held: bubble
    clock.set(busy=True, active=True)
    now[0] = 11.0
    clock.set(busy=False, active=False)
    now[0] = 20.0  # idle and empty: not a bubble
    assert clock.totals() == (6.0, 3.0)
    assert clock.fraction() == 0.5
    assert clock.fraction() == 0.0  # nothing active since the previous reading


@pytest.mark.cluster
def test_the_coordinator_with_its_exporters_imports_no_torch():
    code = (
        "import sys, layerline.coordinator.server, layerline.shared.telemetry\n"
        "from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter\n"
        "from opentelemetry.exporter.prometheus import PrometheusMetricReader\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_step_spans_are_children_of_their_requests_and_say_what_failed():
    exported = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    tracer = provider.get_tracer("test")
    requests, seqs = [], []
    for i in range(3):
        request = tracer.start_span(f"request {i}")
        seq = Sequence(f"s{i}", [1, 2, 3], SamplingParams(), on_token=lambda *a: None, on_error=lambda *a: None)
        if i < 2:  # the third request is not traced: its sequence carries no context
            propagate.inject(seq.trace_context, context=set_span_in_context(request))
        requests.append(request)
        seqs.append(seq)
    step = PlannedStep(tuple(Slice(seq, 0, (1, 2, 3), sample=True) for seq in seqs))

    carriers: list[dict[str, str]] = [{}, {}, {}]
    StepSpans(tracer, step, carriers, chain="a -> b").done(
        [Outcome("s0", token_id=5), Outcome("s1", error_code=8, error_message="KV cache full"), Outcome("s2", 6)]
    )
    by_parent = {span.parent.span_id: span for span in exported.get_finished_spans()}
    ok, full = (by_parent[r.get_span_context().span_id] for r in requests[:2])
    assert len(by_parent) == 2 and ok.name == full.name == "step"
    assert ok.status.status_code == StatusCode.UNSET
    assert (full.status.status_code, full.attributes["error.type"]) == (StatusCode.ERROR, "RESOURCE_EXHAUSTED")
    # Each traced sequence's carrier now holds its step span, the parent of its first hop.
    for carrier, span in zip(carriers, (ok, full)):
        assert get_current_span(propagate.extract(carrier)).get_span_context().span_id == span.context.span_id
    assert carriers[2] == {}  # nothing injected for the untraced request

    exported.clear()
    StepSpans(tracer, step, [{}, {}, {}], chain="a -> b").failed(
        StepFailed(14, "stage b is unreachable", failed_address="b")
    )
    failed = exported.get_finished_spans()
    assert len(failed) == 2
    for span in failed:
        assert span.status.status_code == StatusCode.ERROR and span.status.description == "stage b is unreachable"
        assert (span.attributes["error.type"], span.attributes["layerline.failed_address"]) == ("UNAVAILABLE", "b")
        assert span.attributes["layerline.step.sequences"] == 3 and span.attributes["layerline.step.tokens"] == 9
