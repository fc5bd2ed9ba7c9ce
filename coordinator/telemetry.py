"""What the coordinator measures: each request's span and latencies, each scheduled step's spans.

Owns three things:

- `RequestTelemetry`: one request's span, `{operation} {model}` (kind SERVER, OpenTelemetry's
  `gen_ai.*` names where they exist), a child of the caller's context extracted from the call's
  gRPC metadata; and its latencies (queue time, time to first token, inter-token latency,
  end-to-end) recorded on the span and in histograms.
- `StepSpans`: the spans of one scheduled step, one `step` span per request in it, each a child
  of its request's span, whose context goes to the stages in that sequence's carrier map of the
  step message. Each request thus sees every step it took part in, and below it every hop.
- `CoordinatorTelemetry`: the instruments and the serving gauges (requests running and waiting,
  failovers), and the factory of the two above.

With tracing off there is no tracer: no span, no carrier. With metrics off there is no meter.
Knows nothing of gRPC messages (carriers are plain string maps; status codes come as values and
leave as names) or of the schedule's rules.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass

from opentelemetry import propagate
from opentelemetry.metrics import CallbackOptions, Counter, Histogram, Meter, Observation
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context

from layerline.shared.errors import Code
from layerline.shared.sampling import SamplingParams
from layerline.shared.telemetry import SECONDS_BUCKETS, Telemetry

from .steps import Outcome, PlannedStep, Sequence, StepFailed


@dataclass(frozen=True)
class _Instruments:
    time_to_first_token: Histogram
    inter_token_latency: Histogram
    e2e_latency: Histogram
    queue_time: Histogram
    requests: Counter
    prompt_tokens: Counter
    generation_tokens: Counter

    @classmethod
    def on(cls, meter: Meter) -> _Instruments:
        def seconds(name: str, description: str) -> Histogram:
            return meter.create_histogram(
                name, unit="s", description=description, explicit_bucket_boundaries_advisory=SECONDS_BUCKETS
            )

        return cls(
            time_to_first_token=seconds(
                "layerline_time_to_first_token_seconds", "From a request's arrival to its first generated token"
            ),
            inter_token_latency=seconds(
                "layerline_inter_token_latency_seconds", "Between consecutive generated tokens of one request"
            ),
            e2e_latency=seconds(
                "layerline_e2e_request_latency_seconds", "From a request's arrival to its end, for admitted requests"
            ),
            queue_time=seconds(
                "layerline_request_queue_time_seconds", "From a request's arrival to its admission to a generation slot"
            ),
            requests=meter.create_counter(
                "layerline_requests",
                unit="{request}",
                description="Requests ended, by finish_reason (stop, length, error, cancelled)",
            ),
            prompt_tokens=meter.create_counter(
                "layerline_prompt_tokens", unit="{token}", description="Prompt tokens of admitted requests"
            ),
            generation_tokens=meter.create_counter(
                "layerline_generation_tokens", unit="{token}", description="Tokens generated"
            ),
        )


class CoordinatorTelemetry:
    """The coordinator's tracer and instruments; makes one `RequestTelemetry` per request."""

    def __init__(self, telemetry: Telemetry, *, model_name: str) -> None:
        self.tracer = telemetry.tracer
        self.meter = telemetry.meter
        self.model_name = model_name
        self._instruments = _Instruments.on(self.meter) if self.meter is not None else None

    def watch(
        self,
        *,
        running: Callable[[], int],
        waiting: Callable[[], int],
        failovers: Callable[[], int],
        preemptions: Callable[[], int] = lambda: 0,
        stalls: Callable[[], int] = lambda: 0,
        prefix_queries: Callable[[], int] = lambda: 0,
        prefix_hits: Callable[[], int] = lambda: 0,
        draft_tokens: Callable[[], int] = lambda: 0,
        accepted_tokens: Callable[[], int] = lambda: 0,
    ) -> None:
        """Gauges read at each scrape: requests generating, requests waiting for a slot; counters
        of failovers, preemptions and stalled chains."""
        if self.meter is None:
            return

        def reading(read: Callable[[], int]) -> Callable[[CallbackOptions], Iterable[Observation]]:
            return lambda options: [Observation(read())]

        gauges = (
            ("layerline_num_requests_running", running, "{request}", "Requests admitted and generating"),
            ("layerline_num_requests_waiting", waiting, "{request}", "Requests waiting for a generation slot"),
        )
        counters = (
            ("layerline_failovers", failovers, "{sequence}", "Sequences moved off a failed chain"),
            (
                "layerline_num_preemptions",
                preemptions,
                "{sequence}",
                "Sequences whose KV was freed for an older sequence's and recomputed later",
            ),
            ("layerline_chain_stalls", stalls, "{chain}", "Chains that stopped answering steps within their bound"),
            ("layerline_prefix_cache_queries", prefix_queries, "{token}", "Tokens of started sequences looked up"),
            ("layerline_prefix_cache_hits", prefix_hits, "{token}", "Tokens found in the KV and copied, not computed"),
            ("layerline_spec_decode_num_draft_tokens", draft_tokens, "{token}", "Tokens drafted and verified"),
            ("layerline_spec_decode_num_accepted_tokens", accepted_tokens, "{token}", "Drafted tokens accepted"),
        )
        for name, read, unit, description in gauges:
            self.meter.create_observable_gauge(name, [reading(read)], unit=unit, description=description)
        for name, read, unit, description in counters:
            self.meter.create_observable_counter(name, [reading(read)], unit=unit, description=description)

    def request(
        self,
        metadata: Iterable[tuple[str, str | bytes]] | None,
        *,
        operation: str,
        prompt_tokens: int,
        sequence_id: str,
    ) -> RequestTelemetry:
        """A request arriving now; `metadata` is its call's gRPC metadata (the caller's context)."""
        span = None
        if self.tracer is not None:
            carrier = {key: value for key, value in metadata or () if isinstance(value, str)}
            span = self.tracer.start_span(
                f"{operation} {self.model_name}",
                context=propagate.extract(carrier),
                kind=SpanKind.SERVER,
                attributes={
                    "gen_ai.operation.name": operation,
                    "gen_ai.request.model": self.model_name,
                    "gen_ai.response.id": sequence_id,
                    "gen_ai.usage.input_tokens": prompt_tokens,
                },
            )
        return RequestTelemetry(span, self._instruments, prompt_tokens=prompt_tokens, model_name=self.model_name)


class RequestTelemetry:
    """One request, from its arrival (construction) to `end()`."""

    def __init__(
        self, span: Span | None, instruments: _Instruments | None, *, prompt_tokens: int, model_name: str
    ) -> None:
        self.span = span
        self._instruments = instruments
        self._model_name = model_name
        self.prompt_tokens = prompt_tokens
        self.arrived = time.monotonic()
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self._last_token_at = 0.0
        self.completion_tokens = 0
        self.finish_reason: str | None = None  # stop, length, error or cancelled, once known
        self.sequence: Sequence | None = None  # once admitted
        self._ended = False

    def set_sampling(self, sampling: SamplingParams, *, max_tokens: int) -> None:
        """The request's sampling parameters, once checked."""
        if self.span is None:
            return
        self.span.set_attributes(
            {
                "gen_ai.request.max_tokens": max_tokens,
                "gen_ai.request.temperature": sampling.temperature,
                "gen_ai.request.top_p": sampling.top_p,
                "gen_ai.request.top_k": sampling.top_k,
            }
        )
        if sampling.seed is not None:
            self.span.set_attribute("gen_ai.request.seed", sampling.seed)

    def admitted(self, sequence: Sequence) -> None:
        """The request got a generation slot; its sequence carries the request's trace context."""
        self.admitted_at = time.monotonic()
        self.sequence = sequence
        if self.span is not None and self.span.is_recording():
            propagate.inject(sequence.trace_context, context=set_span_in_context(self.span))
        if self._instruments is not None:
            self._instruments.queue_time.record(self.admitted_at - self.arrived)
            self._instruments.prompt_tokens.add(self.prompt_tokens)

    @property
    def on_token(self) -> Callable[[float], None] | None:
        """What the generation calls with the time of each new token; None when nothing is kept."""
        return self._token if self._instruments is not None or self.span is not None else None

    def _token(self, at: float) -> None:
        self.completion_tokens += 1
        if self.first_token_at is None:
            self.first_token_at = at
            if self._instruments is not None:
                self._instruments.time_to_first_token.record(at - self.arrived)
        elif self._instruments is not None:
            self._instruments.inter_token_latency.record(at - self._last_token_at)
        self._last_token_at = at

    def finished(self, reason: str) -> None:
        """The last token is in: the request ends now, before its last response goes out."""
        self.finish_reason = reason
        self.end()

    def failed(self, code: str, message: str, *, cancelled: bool = False) -> None:
        """The request ended with gRPC status `code` (a StatusCode name)."""
        if self._ended:  # it had finished; only its last response was lost
            return
        self.finish_reason = "cancelled" if cancelled else "error"
        if self.span is not None:
            self.span.set_attribute("error.type", code)
            self.span.set_status(Status(StatusCode.ERROR, message))

    def end(self) -> None:
        """Record the request's totals and end its span, once (later calls do nothing)."""
        if self._ended:
            return
        self._ended = True
        now = time.monotonic()
        reason = self.finish_reason or "error"
        if self._instruments is not None:
            self._instruments.requests.add(1, {"finish_reason": reason})
            self._instruments.generation_tokens.add(self.completion_tokens)
            if self.admitted_at is not None:
                self._instruments.e2e_latency.record(now - self.arrived)
        if self.span is None:
            return
        attributes: dict[str, str | int | float | list[str]] = {
            "gen_ai.response.model": self._model_name,
            "gen_ai.usage.output_tokens": self.completion_tokens,
            "gen_ai.response.finish_reasons": [reason],
            "layerline.request.e2e_seconds": now - self.arrived,
            "layerline.request.failovers": self.sequence.moves if self.sequence is not None else 0,
        }
        if self.admitted_at is not None:
            attributes["layerline.request.queue_seconds"] = self.admitted_at - self.arrived
        if self.first_token_at is not None:
            attributes["layerline.request.time_to_first_token_seconds"] = self.first_token_at - self.arrived
            attributes["gen_ai.response.time_to_first_chunk"] = self.first_token_at - self.arrived
        self.span.set_attributes(attributes)
        self.span.end()


class StepSpans:
    """The `step` spans of one scheduled step: one per traced request in it, child of its span.

    Each span's context is injected into `carriers[i]`, the trace carrier of the step message's
    i-th sequence, so each stage's hop span for that request is the step span's child.
    """

    def __init__(
        self, tracer: Tracer, step: PlannedStep, carriers: list[MutableMapping[str, str]], *, chain: str
    ) -> None:
        tokens = sum(len(s.token_ids) for s in step.slices)
        self._spans: dict[str, Span] = {}
        for s, carrier in zip(step.slices, carriers):
            if not s.seq.trace_context:
                continue
            span = tracer.start_span(
                "step",
                context=propagate.extract(s.seq.trace_context),
                kind=SpanKind.CLIENT,
                attributes={
                    "layerline.chain": chain,
                    "layerline.step.sequences": len(step.slices),
                    "layerline.step.tokens": tokens,
                    "layerline.sequence.tokens": len(s.token_ids),
                    "layerline.sequence.first_position": s.start,
                    "layerline.sequence.samples": s.sample,
                },
            )
            propagate.inject(carrier, context=set_span_in_context(span))
            self._spans[s.seq.kv_id] = span  # outcomes name the KV

    def done(self, outcomes: list[Outcome]) -> None:
        """The step came back: a span whose sequence failed on a stage gets that error."""
        errors = {o.sequence_id: o for o in outcomes if o.error_code}
        for sequence_id, span in self._spans.items():
            error = errors.get(sequence_id)
            if error is not None:
                span.set_attribute("error.type", _code_name(error.error_code))
                span.set_status(Status(StatusCode.ERROR, error.error_message))
            span.end()

    def failed(self, err: StepFailed) -> None:
        """The whole step failed (a hop is gone): every span says so."""
        for span in self._spans.values():
            span.set_attribute("error.type", _code_name(err.code))
            if err.failed_address:
                span.set_attribute("layerline.failed_address", err.failed_address)
            span.set_status(Status(StatusCode.ERROR, str(err)))
            span.end()


def _code_name(value: int) -> str:
    """A gRPC status code value's name ("UNAVAILABLE"), as `error.type` wants it."""
    return Code.of(value).name
