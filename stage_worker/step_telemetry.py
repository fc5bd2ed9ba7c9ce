"""What a stage worker measures: each step's phases, each request's span on this hop, the gauges.

Owns
- `StepClock`: a step's hooks doing nothing, in place of its `StepTimes` when telemetry is off;
  what only telemetry needs (sizes, carriers, errors) comes lazily, so that it costs nothing then.
- `StepTimes`: the clock of one step through this stage: its header's arrival, the bytes and
  decode time of its hidden states, its wait for the compute thread, compute, serialization and
  the write to the next hop, and its answer going back up (compute includes making the received
  bytes a tensor, and an output that goes in one frame into bytes: codec.WireTensor). When tracing, each request in the
  step whose carrier holds a sampled context gets its own span on this hop, `stage START:END`
  (kind SERVER), a child of that request's span on the hop before; its context replaces the
  carrier in the step this stage forwards, so the next hop's span is its child in turn. The span
  runs from the header's arrival to the answer, and carries the step's figures as attributes.
- `StreamTelemetry`: the steps of one upstream Step stream not answered yet, by step id.
- `StageTelemetry`: the stage's tracer and instruments, and the gauges read at each scrape:
  KV blocks used and free, and the pipeline bubble fraction (`BusyClock`); the count of orphaned
  sequences freed. With tracing and metrics off (`on` False), its streams give `StepClock`s and
  it measures nothing.

Its callers (frames, compute, delivery, the servicer) hand in plain values: ids, carriers, sizes,
messages of errors; it never reads a wire message. Knows nothing of the model or tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Protocol, TypeVar

from opentelemetry import propagate
from opentelemetry.metrics import CallbackOptions, Histogram, Observation
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context

from layerline.shared.telemetry import BYTES_BUCKETS, SECONDS_BUCKETS, Telemetry

from .busy_clock import BusyClock
from .engine import SequenceStep


class _Frame(Protocol):
    def ByteSize(self) -> int: ...


F = TypeVar("F", bound=_Frame)


class StepClock:
    """The hooks of one step through this stage, measuring nothing (telemetry off); see `StepTimes`."""

    def chunk(self, seconds: float, *, size: Callable[[], int] | None = None) -> None:
        """A chunk of hidden states took `seconds` to decode; `size()`: its bytes, if not the header's."""

    def ready(self) -> None:
        """The step is whole and about to be computed."""

    def computing(self) -> AbstractContextManager[None]:
        """Around the step's compute, on whichever thread runs it."""
        return nullcontext()

    def forwarding(
        self,
        next_hop: str,
        carriers: Iterable[tuple[str, MutableMapping[str, str]]],
        frames: Iterable[F],
        *,
        header_size: Callable[[], int],
        serialize_seconds: float = 0.0,
    ) -> Iterable[F]:
        """The step is about to go to `next_hop`: each request's carrier, of the forwarded step's
        (sequence id, carrier) pairs, gets its span here. Returns `frames`, timed as they are
        serialized (after `serialize_seconds` spent encoding) and counted as they are written;
        `header_size()` is read once the header, with its hidden states if they fit, went out.
        When the writer asks for a frame past the last, all are written."""
        return frames

    def end(self, *, error: str | None, sequence_errors: Iterable[tuple[str, str]] = ()) -> None:
        """This stage is done with the step (sent it on, or answered it): its requests' spans end,
        with the step's figures; `sequence_errors` are (sequence id, message). Only the first call counts."""


_QUIET_STEP = StepClock()


class StageTelemetry:
    """A stage's tracer, instruments and gauges; `on` is False when tracing and metrics are off."""

    def __init__(self, telemetry: Telemetry, *, layers: str, kv_blocks: Callable[[], tuple[int, int]]) -> None:
        """`kv_blocks()` gives (used, free) KV blocks, read at scrapes and after compute."""
        self.on = telemetry.tracer is not None or telemetry.meter is not None
        self.tracer = telemetry.tracer
        self.span_name = f"stage {layers}"
        self.layers = layers
        self.kv_blocks = kv_blocks
        self.clock = BusyClock()
        meter = telemetry.meter
        self.metrics = meter is not None
        if meter is None:
            return

        def histogram(name: str, description: str, *, unit: str = "s") -> Histogram:
            buckets = BYTES_BUCKETS if unit == "By" else SECONDS_BUCKETS
            return meter.create_histogram(
                name, unit=unit, explicit_bucket_boundaries_advisory=buckets, description=description
            )

        self.step_seconds = histogram("layerline_stage_step_seconds", "Compute time of one step on this stage")
        self.queue_seconds = histogram(
            "layerline_stage_queue_seconds", "Time a received step waited for this stage's compute thread"
        )
        self.hop_bytes = histogram(
            "layerline_hop_bytes",
            "Bytes of one step's frames received from the hop before (direction=received) "
            "or sent to the next hop (direction=sent)",
            unit="By",
        )
        self.hop_seconds = histogram(
            "layerline_hop_transfer_seconds", "Time to write one step's frames to the next hop, serialization excluded"
        )
        labels = {"layers": layers}

        def gauge(read: Callable[[], float]) -> list[Callable[[CallbackOptions], Iterable[Observation]]]:
            return [lambda options: [Observation(read(), labels)]]

        meter.create_observable_gauge(
            "layerline_kv_blocks_used",
            gauge(lambda: kv_blocks()[0]),
            unit="{block}",
            description="KV cache blocks holding sequences",
        )
        meter.create_observable_gauge(
            "layerline_kv_blocks_free",
            gauge(lambda: kv_blocks()[1]),
            unit="{block}",
            description="KV cache blocks free",
        )
        meter.create_observable_gauge(
            "layerline_pipeline_bubble_fraction",
            gauge(self.clock.fraction),
            unit="1",
            description="Share of the time this stage held live sequences but computed nothing, "
            "since the previous scrape",
        )
        meter.create_observable_counter(
            "layerline_stage_active_seconds",
            gauge(lambda: self.clock.totals()[0]),
            unit="s",
            description="Time this stage held live sequences",
        )
        self.orphans_freed = meter.create_counter(
            "layerline_stage_orphans_freed",
            unit="{sequence}",
            description="Sequences whose KV this stage freed because no coordinator would step them again: "
            "reason=unknown (a coordinator registered this stage without knowing it) or reason=ttl "
            "(no step touched them for --orphan-ttl seconds)",
        )
        meter.create_observable_counter(
            "layerline_stage_bubble_seconds",
            gauge(lambda: self.clock.totals()[1]),
            unit="s",
            description="Time this stage held live sequences but computed nothing",
        )

    @classmethod
    def of(cls, telemetry: Telemetry, *, layers: str, kv_blocks: Callable[[], tuple[int, int]]) -> StageTelemetry:
        """The stage's telemetry; with tracing and metrics off, its hooks do nothing."""
        return cls(telemetry, layers=layers, kv_blocks=kv_blocks)

    def stream(self) -> StreamTelemetry:
        return StreamTelemetry(self)

    def released(self) -> None:
        """Sequences were released outside a step: the stage may have become inactive."""
        if self.on:
            self.clock.set_active(self.kv_blocks()[0] > 0)

    def orphans(self, freed: int, *, reason: str) -> None:
        """`freed` sequences no coordinator would step again were released; `reason`: unknown or ttl."""
        if self.metrics and freed:
            self.orphans_freed.add(freed, {"layers": self.layers, "reason": reason})
        self.released()


class StreamTelemetry:
    """The steps of one upstream Step stream, from their header's arrival to their answer."""

    def __init__(self, stage: StageTelemetry) -> None:
        self.stage = stage
        self._open: dict[int, StepTimes] = {}

    def received(
        self,
        step_id: int,
        seqs: Sequence[SequenceStep],
        carriers: Iterable[Mapping[str, str]],
        *,
        header_bytes: Callable[[], int],
    ) -> StepClock:
        """A step's header arrived; the i-th carrier is the trace carrier of `seqs[i]`."""
        if not self.stage.on:
            return _QUIET_STEP
        times = self._open[step_id] = StepTimes(self.stage, seqs, carriers, header_bytes=header_bytes())
        return times

    def answered(self, step_id: int, *, error: str | None, sequence_errors: Iterable[tuple[str, str]] = ()) -> None:
        """The step's answer went up: `error` failed all of it, `sequence_errors` some sequences."""
        times = self._open.pop(step_id, None)
        if times is not None:
            times.end(error=error, sequence_errors=sequence_errors)

    def close(self) -> None:
        """The stream ended: steps never answered end their spans as failed."""
        for times in self._open.values():
            times.end(error="the Step stream closed before the step was answered")
        self._open.clear()


class StepTimes(StepClock):
    """One step through this stage (perf_counter seconds) and its requests' hop spans."""

    def __init__(
        self,
        stage: StageTelemetry,
        seqs: Sequence[SequenceStep],
        carriers: Iterable[Mapping[str, str]],
        *,
        header_bytes: int,
    ) -> None:
        self.stage = stage
        self.arrived = time.perf_counter()
        self.ready_at = self.arrived  # all of its hidden states are in
        self.compute_started = self.compute_ended = 0.0
        self.sequences = len(seqs)
        self.tokens = sum(s.num_tokens for s in seqs)
        self.bytes_received = header_bytes
        self.deserialize_seconds = 0.0
        self.bytes_sent = 0
        self.serialize_seconds = 0.0
        self.send_seconds = 0.0
        self.next_hop = ""  # set when the step is forwarded
        self._header_size: Callable[[], int] = lambda: 0  # of the forwarded header, once it went out
        self._send_started = 0.0
        self._sent = False
        self.spans: dict[str, Span] = {}
        if stage.tracer is None:
            return
        start = time.time_ns()
        for seq, carrier in zip(seqs, carriers):
            if not carrier:
                continue
            span = stage.tracer.start_span(
                stage.span_name,
                context=propagate.extract(carrier),
                kind=SpanKind.SERVER,
                start_time=start,
                attributes={
                    "layerline.stage.layers": stage.layers,
                    "layerline.sequence.tokens": seq.num_tokens,
                    "layerline.sequence.first_position": seq.positions[0] if seq.positions else 0,
                },
            )
            if span.is_recording():  # the sampler may decline a request (OTEL_TRACES_SAMPLER)
                self.spans[seq.sequence_id] = span

    def chunk(self, seconds: float, *, size: Callable[[], int] | None = None) -> None:
        if size is not None:
            self.bytes_received += size()
        self.deserialize_seconds += seconds

    def ready(self) -> None:
        self.ready_at = time.perf_counter()
        if self.stage.metrics:
            self.stage.hop_bytes.record(self.bytes_received, {"layers": self.stage.layers, "direction": "received"})

    @contextmanager
    def computing(self) -> Iterator[None]:
        stage = self.stage
        self.compute_started = time.perf_counter()
        stage.clock.set(busy=True, active=True)
        try:
            yield
        finally:
            self.compute_ended = time.perf_counter()
            stage.clock.set(busy=False, active=stage.kv_blocks()[0] > 0)
            if stage.metrics:
                labels = {"layers": stage.layers}
                stage.step_seconds.record(self.compute_ended - self.compute_started, labels)
                stage.queue_seconds.record(self.compute_started - self.ready_at, labels)

    def forwarding(
        self,
        next_hop: str,
        carriers: Iterable[tuple[str, MutableMapping[str, str]]],
        frames: Iterable[F],
        *,
        header_size: Callable[[], int],
        serialize_seconds: float = 0.0,
    ) -> Iterator[F]:
        self.serialize_seconds = serialize_seconds
        for sequence_id, carrier in carriers:
            span = self.spans.get(sequence_id)
            if span is not None:
                carrier.clear()
                propagate.inject(carrier, context=set_span_in_context(span))
        self.next_hop = next_hop
        self._header_size = header_size
        self._send_started = time.perf_counter() - serialize_seconds  # when encoding began
        return self._timed(frames)

    def _timed(self, frames: Iterable[F]) -> Iterator[F]:
        self.bytes_sent = self._header_size()  # read once the header went out, with the hop's step id
        it = iter(frames)
        while True:
            start = time.perf_counter()
            frame = next(it, None)
            self.serialize_seconds += time.perf_counter() - start
            if frame is None:
                self._written()
                return
            self.bytes_sent += frame.ByteSize()
            yield frame

    def _written(self) -> None:
        if self._sent:
            return
        self._sent = True
        if not self.bytes_sent:  # the answer came back before the writer resumed after the header
            self.bytes_sent = self._header_size()
        self.send_seconds = time.perf_counter() - self._send_started - self.serialize_seconds
        if self.stage.metrics:
            labels = {"layers": self.stage.layers, "peer": self.next_hop}
            self.stage.hop_bytes.record(self.bytes_sent, {**labels, "direction": "sent"})
            self.stage.hop_seconds.record(self.send_seconds, labels)

    def end(self, *, error: str | None, sequence_errors: Iterable[tuple[str, str]] = ()) -> None:
        if not self.spans:
            return
        failures = dict(sequence_errors)
        end = time.time_ns()
        attributes: dict[str, str | int | float] = {
            "layerline.step.sequences": self.sequences,
            "layerline.step.tokens": self.tokens,
            "layerline.step.bytes_received": self.bytes_received,
            "layerline.step.receive_seconds": self.ready_at - self.arrived,
            "layerline.step.deserialize_seconds": self.deserialize_seconds,
        }
        if self.compute_ended:
            attributes["layerline.step.queue_seconds"] = self.compute_started - self.ready_at
            attributes["layerline.step.compute_seconds"] = self.compute_ended - self.compute_started
        if self.next_hop:
            if error is None:  # an answer came back, so every frame reached the next hop, even if
                self._written()  # the writer has not yet been told that its last write completed
            attributes["layerline.next_hop"] = self.next_hop
            attributes["layerline.step.bytes_sent"] = self.bytes_sent
            attributes["layerline.step.serialize_seconds"] = self.serialize_seconds
            if self._sent:
                attributes["layerline.step.send_seconds"] = self.send_seconds
        for sequence_id, span in self.spans.items():
            span.set_attributes(attributes)
            failure = error or failures.get(sequence_id)
            if failure:
                span.set_status(Status(StatusCode.ERROR, failure))
            span.end(end_time=end)
        self.spans = {}
