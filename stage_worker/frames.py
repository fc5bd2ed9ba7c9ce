"""The frames of one upstream Step stream, reassembled into whole, validated steps.

Owns the Step stream's framing: a step is a header frame, carrying the step's hidden states
whole when they fit in one message, else followed by `hidden_chunk` frames until the tensor is
complete (the first stage takes no hidden states: its header is the whole step). Owns checking
a header against this stage and turning its sequences into `SequenceStep`s: first the length of
every repeated field and string against `StepRules` (O(1) each, nothing built yet: sequences,
positions summed over them, token ids, history, route, chain, released ids, trace carriers, ids),
then this stage's model id, unique sequence ids, and a route exactly when this stage is not the
last. The hidden states' declared dtype and shape are checked at their first chunk: a floating
dtype, and [the step's tokens, hidden_size], so that no more than the step's bytes are kept.

A malformed step is rejected with its error and the stream goes on: a new header before the
hidden states were complete, a chunk with no header before it, a chunk that does not decode or
is not the step's, a header carrying only part of its tensor, a stream ending mid-step. The
chunks of a step already rejected are skipped without another answer. Errors quote at most a
short prefix of what the caller sent.

Knows nothing of gRPC, of the engine or of where a step goes next; tensor bytes are the codec's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from layerline.protos.v1 import stage_pb2, tensor_pb2
from layerline.shared.errors import OverLimit
from layerline.shared.model_config import LayerRange
from layerline.shared.wire import sampling_from_wire

from .codec import CodecLimits, Expect, FrameError, Reassembler, WireTensor, dtype_to_wire
from .engine import SequenceStep, StepInputError
from .step_telemetry import StepClock, StreamTelemetry


@dataclass(frozen=True)
class StepRules:
    """What a step's header must satisfy on this stage."""

    model_id: str  # the model this stage serves; a header naming another is refused
    layers: LayerRange  # this stage's layers, named in errors
    is_first: bool  # the first stage takes token ids, so its header is the whole step
    is_last: bool  # the last stage samples, and its steps carry no route
    max_sequences: int  # sequences in one step, and ids in its release_sequence_ids
    hidden_size: int  # a step's hidden states are [its tokens, hidden_size]
    max_step_tokens: int = 8192  # positions summed over a step's sequences (the engine's limit)
    max_history: int = 8192  # history_token_ids of one sequence: at most the model's context
    max_route_hops: int = 64  # addresses in a step's route, and in its chain
    max_id_bytes: int = 128  # UTF-8 bytes of model_id, a sequence_id, a prefix_from, a released id, reply.subscriber
    max_trace_entries: int = 8  # entries of one sequence's trace_context
    max_trace_bytes: int = 512  # UTF-8 bytes of a trace_context key or value (W3C tracestate: up to 512)


class StepLimitError(StepInputError, OverLimit):
    """A step's header is past a StepRules bound (a list too long, a string too large)."""


@dataclass
class ReceivedStep:
    """A step whose header was valid and whose hidden states (past the first stage) are whole."""

    header: stage_pb2.StepHeader
    seqs: list[SequenceStep]
    times: StepClock  # its telemetry hooks (doing nothing when telemetry is off)
    wire: WireTensor | None = None  # its hidden states' bytes as received; None on the first stage
    chain: str = ""  # the route it came by, once checked (`routing`)
    since: int = 0  # tasks the compute thread had begun when it was computed (`compute`)
    sent: WireTensor | None = None  # the hidden states computed here, as the next hop gets them (`compute`)

    @property
    def hidden(self) -> torch.Tensor | None:
        """The received hidden states, [sum of tokens, hidden_size], made a tensor on the thread
        that asks first (the compute thread: see codec.WireTensor)."""
        if self._hidden is None and self.wire is not None:
            self._hidden = self.wire.tensor()
        return self._hidden

    _hidden: torch.Tensor | None = field(default=None, init=False, repr=False)


@dataclass(frozen=True)
class Rejected:
    """A step answered with its error instead of computed (step id 0 when it had no header)."""

    step_id: int
    error: Exception  # a StepInputError or FrameError


@dataclass
class Pushed:
    """What one frame did to the stream: the steps it began, rejected, and completed."""

    arrived: int = 0  # steps begun (a header, or a stray chunk answered): in flight from now on
    rejected: list[Rejected] = field(default_factory=list)  # to answer first, in order
    steps: list[ReceivedStep] = field(default_factory=list)  # whole: to compute, in order


class StepAssembler:
    """The reassembly state of one Step stream: `push` each frame as it arrives, then `end`."""

    def __init__(self, rules: StepRules, *, codec: CodecLimits, telemetry: StreamTelemetry) -> None:
        self.rules = rules
        self.telemetry = telemetry
        self._reassembler = Reassembler(limits=codec)
        self._current: ReceivedStep | None = None  # a step whose hidden states are still arriving
        self._expect: Expect | None = None  # the check of the current step's hidden states
        self._failed_id: int | None = None  # a rejected step whose remaining chunks are skipped

    def push(self, frame: stage_pb2.StepFrame) -> Pushed:
        pushed = Pushed()
        kind = frame.WhichOneof("frame")
        if kind == "header":
            self._header(frame.header, pushed)
        elif kind == "hidden_chunk":
            self._chunk(frame, pushed)
        return pushed

    def end(self) -> Pushed:
        """The stream ended: a step still waiting for hidden states is rejected."""
        pushed = Pushed()
        if self._current is not None:
            pushed.rejected.append(
                _incomplete(self._current, "the stream ended before the step's hidden states were complete")
            )
        return pushed

    def _header(self, header: stage_pb2.StepHeader, pushed: Pushed) -> None:
        if self._current is not None:
            pushed.rejected.append(
                _incomplete(self._current, "a new header arrived before the step's hidden states were complete")
            )
            self._reassembler.reset()
        self._current, self._failed_id = None, None
        pushed.arrived += 1
        try:
            seqs = _decode_header(header, self.rules)
        except StepInputError as err:
            pushed.rejected.append(Rejected(header.step_id, err))
            self._failed_id = header.step_id
            return
        step = ReceivedStep(
            header,
            seqs,
            times=self.telemetry.received(
                header.step_id,
                seqs,
                (s.trace_context for s in header.sequences),
                header_bytes=header.ByteSize,
            ),
        )
        tokens = sum(s.num_tokens for s in seqs)
        if header.HasField("hidden"):  # the whole tensor, in the header
            started = time.perf_counter()
            try:
                expect = _hidden_shape("header.hidden", tokens, self.rules.hidden_size)
                step.wire = _hidden_states(self._reassembler, header.hidden, whole=True, expect=expect)
            except FrameError as err:
                pushed.rejected.append(Rejected(header.step_id, err))
                self._failed_id = header.step_id
                return
            step.times.chunk(time.perf_counter() - started)  # its bytes were counted with the header's
        if self.rules.is_first or step.wire is not None:
            pushed.steps.append(step)
        else:
            self._current = step
            self._expect = _hidden_shape("hidden_chunk", tokens, self.rules.hidden_size)

    def _chunk(self, frame: stage_pb2.StepFrame, pushed: Pushed) -> None:
        step = self._current
        if step is None:
            if self._failed_id is None:
                pushed.arrived += 1
                pushed.rejected.append(Rejected(0, FrameError("hidden_chunk frame without a step header before it")))
                self._failed_id = 0
            return
        started = time.perf_counter()
        try:
            tensor = _hidden_states(self._reassembler, frame.hidden_chunk, whole=False, expect=self._expect)
        except FrameError as err:
            pushed.rejected.append(Rejected(step.header.step_id, err))
            self._failed_id, self._current = step.header.step_id, None
            self._reassembler.reset()
            return
        step.times.chunk(time.perf_counter() - started, size=frame.ByteSize)
        if tensor is not None:
            step.wire = tensor
            pushed.steps.append(step)
            self._current = None


def _decode_header(header: stage_pb2.StepHeader, rules: StepRules) -> list[SequenceStep]:
    _check_lengths(header, rules)
    if header.model_id != rules.model_id:
        if not header.model_id:
            raise StepInputError(
                f"model_id is empty: a step names the model it was routed for (this stage serves {rules.model_id!r})"
            )
        raise StepInputError(f"model_id {_quoted(header.model_id)} differs from this stage's {rules.model_id!r}")
    seen: set[str] = set()
    for s in header.sequences:
        if s.sequence_id in seen:
            raise StepInputError(f"sequence {s.sequence_id!r} appears twice in one step")
        seen.add(s.sequence_id)
    if rules.is_last and header.route:
        raise StepInputError("route must be empty at the last stage")
    if not rules.is_last and not header.route:
        raise StepInputError(f"stage {rules.layers} is not the last: route must name the next hop")
    if rules.is_first and header.HasField("hidden"):
        raise StepInputError("header.hidden is set: the first stage takes token ids, not hidden states")
    return [_sequence_step(s, last=rules.is_last) for s in header.sequences]


def _check_lengths(header: stage_pb2.StepHeader, rules: StepRules) -> None:
    """Every repeated field and string of the header within its bound, before anything is built
    from them: `len` of a repeated field is O(1), and the loop runs over at most max_sequences."""
    _at_most("sequences", len(header.sequences), rules.max_sequences, "max_sequences")
    _at_most("route", len(header.route), rules.max_route_hops, "max_route_hops")
    _at_most("chain", len(header.chain), rules.max_route_hops, "max_route_hops")
    _at_most("release_sequence_ids", len(header.release_sequence_ids), rules.max_sequences, "max_sequences")
    _short("model_id", header.model_id, rules.max_id_bytes, "max_id_bytes")
    _short("reply.subscriber", header.reply.subscriber, rules.max_id_bytes, "max_id_bytes")
    for i, sid in enumerate(header.release_sequence_ids):
        _short(f"release_sequence_ids[{i}]", sid, rules.max_id_bytes, "max_id_bytes")
    tokens = 0
    for i, s in enumerate(header.sequences):
        name = f"sequences[{i}]"
        positions = len(s.positions)
        tokens += positions
        if tokens > rules.max_step_tokens:
            raise StepLimitError(
                f"{name}.positions brings the step to {tokens} positions: at most max_step_tokens = "
                f"{rules.max_step_tokens}"
            )
        if len(s.token_ids) > positions:
            raise StepLimitError(
                f"{name}.token_ids holds {len(s.token_ids)} ids for {positions} positions: at most one per position"
            )
        _at_most(f"{name}.history_token_ids", len(s.history_token_ids), rules.max_history, "max_history", what="ids")
        _short(f"{name}.sequence_id", s.sequence_id, rules.max_id_bytes, "max_id_bytes")
        _short(f"{name}.prefix_from", s.prefix_from, rules.max_id_bytes, "max_id_bytes")
        _at_most(f"{name}.trace_context", len(s.trace_context), rules.max_trace_entries, "max_trace_entries")
        for key, value in s.trace_context.items():
            _short(f"{name}.trace_context key", key, rules.max_trace_bytes, "max_trace_bytes")
            _short(f"{name}.trace_context[{_quoted(key)}]", value, rules.max_trace_bytes, "max_trace_bytes")


def _at_most(name: str, count: int, bound: int, rule: str, *, what: str = "entries") -> None:
    if count > bound:
        raise StepLimitError(f"{name} holds {count} {what}: at most {rule} = {bound}")


def _short(name: str, text: str, bound: int, rule: str) -> None:
    """At most `bound` UTF-8 bytes (a str of n characters has n to 4n of them: short ones are not encoded)."""
    if len(text) * 4 > bound and (size := len(text.encode())) > bound:
        raise StepLimitError(f"{name} is {size} bytes: at most {rule} = {bound}")


def _quoted(text: str, keep: int = 64) -> str:
    """`text` for an error message: its repr, cut to `keep` characters."""
    return repr(text) if len(text) <= keep else repr(text[:keep]) + "..."


def _sequence_step(msg: stage_pb2.SequenceInput, *, last: bool) -> SequenceStep:
    sampling = sampling_from_wire(msg.sampling) if last and msg.sample else None
    return SequenceStep(
        sequence_id=msg.sequence_id,
        positions=tuple(msg.positions),
        token_ids=tuple(msg.token_ids),
        sampling=sampling,
        history=tuple(msg.history_token_ids) if sampling is not None else (),  # only sampling reads it
        prefix_from=msg.prefix_from,
        draft=msg.draft,
        rewind=msg.rewind,
    )


def _hidden_shape(name: str, tokens: int, hidden_size: int) -> Expect:
    """The check of a step's hidden states at their first chunk: floating, [tokens, hidden_size]."""

    def expect(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        if not dtype.is_floating_point:
            raise FrameError(
                f"{name}.dtype is {tensor_pb2.DType.Name(dtype_to_wire(dtype))}: hidden states need a floating"
                " dtype (FLOAT32, BFLOAT16 or FLOAT16)"
            )
        if shape != (tokens, hidden_size):
            raise FrameError(
                f"{name}.shape = {list(shape)}: the step's {tokens} positions need [{tokens}, {hidden_size}]"
                " (tokens x hidden_size)"
            )

    return expect


def _hidden_states(
    reassembler: Reassembler, piece: tensor_pb2.TensorChunk, *, whole: bool, expect: Expect | None
) -> WireTensor | None:
    """Add one chunk of a step's hidden states; the tensor's bytes once complete. `whole`: they must be."""
    tensor = reassembler.add_wire(piece, expect=expect)
    if tensor is None and whole:
        reassembler.reset()
        raise FrameError(
            f"header.hidden holds {len(piece.data)} of the tensor's {piece.total_bytes} bytes: "
            "a header carries its hidden states whole, or sends them as hidden_chunk frames"
        )
    return tensor


def _incomplete(step: ReceivedStep, message: str) -> Rejected:
    return Rejected(step.header.step_id, FrameError(message))
