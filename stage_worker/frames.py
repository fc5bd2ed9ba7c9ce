"""The frames of one upstream Step stream, reassembled into whole, validated steps.

Owns the Step stream's framing: a step is a header frame, carrying the step's hidden states
whole when they fit in one message, else followed by `hidden_chunk` frames until the tensor is
complete (the first stage takes no hidden states: its header is the whole step). Owns checking
a header against this stage (model id, number of sequences, unique sequence ids, a route
exactly when this stage is not the last) and turning its sequences into `SequenceStep`s.

A malformed step is rejected with its error and the stream goes on: a new header before the
hidden states were complete, a chunk with no header before it, a chunk that does not decode,
hidden states that are not floating point, a header carrying only part of its tensor, a stream
ending mid-step. The chunks of a step already rejected are skipped without another answer.

Knows nothing of gRPC, of the engine or of where a step goes next; tensor bytes are the codec's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from layerline.protos.v1 import stage_pb2, tensor_pb2
from layerline.shared.model_config import LayerRange
from layerline.shared.wire import sampling_from_wire

from .codec import CodecLimits, FrameError, Reassembler
from .engine import SequenceStep, StepInputError
from .step_telemetry import StepClock, StreamTelemetry


@dataclass(frozen=True)
class StepRules:
    """What a step's header must satisfy on this stage."""

    model_id: str  # the model this stage serves; a header naming another is refused
    layers: LayerRange  # this stage's layers, named in errors
    is_first: bool  # the first stage takes token ids, so its header is the whole step
    is_last: bool  # the last stage samples, and its steps carry no route
    max_sequences: int  # sequences in one step


@dataclass
class ReceivedStep:
    """A step whose header was valid and whose hidden states (past the first stage) are whole."""

    header: stage_pb2.StepHeader
    seqs: list[SequenceStep]
    times: StepClock  # its telemetry hooks (doing nothing when telemetry is off)
    hidden: torch.Tensor | None = None  # [sum of tokens, hidden_size]; None on the first stage


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
        if header.HasField("hidden"):  # the whole tensor, in the header
            started = time.perf_counter()
            try:
                step.hidden = _hidden_states(self._reassembler, header.hidden, whole=True)
            except FrameError as err:
                pushed.rejected.append(Rejected(header.step_id, err))
                self._failed_id = header.step_id
                return
            step.times.chunk(time.perf_counter() - started)  # its bytes were counted with the header's
        if self.rules.is_first or step.hidden is not None:
            pushed.steps.append(step)
        else:
            self._current = step

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
            tensor = _hidden_states(self._reassembler, frame.hidden_chunk, whole=False)
        except FrameError as err:
            pushed.rejected.append(Rejected(step.header.step_id, err))
            self._failed_id, self._current = step.header.step_id, None
            self._reassembler.reset()
            return
        step.times.chunk(time.perf_counter() - started, size=frame.ByteSize)
        if tensor is not None:
            step.hidden = tensor
            pushed.steps.append(step)
            self._current = None


def _decode_header(header: stage_pb2.StepHeader, rules: StepRules) -> list[SequenceStep]:
    if header.model_id and header.model_id != rules.model_id:
        raise StepInputError(f"step model_id {header.model_id!r} differs from this stage's {rules.model_id!r}")
    if len(header.sequences) > rules.max_sequences:
        raise StepInputError(
            f"step carries {len(header.sequences)} sequences, above the limit of {rules.max_sequences}"
        )
    ids = [s.sequence_id for s in header.sequences]
    if len(set(ids)) < len(ids):
        twice = next(i for i in ids if ids.count(i) > 1)
        raise StepInputError(f"sequence {twice!r} appears twice in one step")
    if rules.is_last and header.route:
        raise StepInputError("route must be empty at the last stage")
    if not rules.is_last and not header.route:
        raise StepInputError(f"stage {rules.layers} is not the last: route must name the next hop")
    return [_sequence_step(s, last=rules.is_last) for s in header.sequences]


def _sequence_step(msg: stage_pb2.SequenceInput, *, last: bool) -> SequenceStep:
    sampling = sampling_from_wire(msg.sampling) if last and msg.sample else None
    return SequenceStep(
        sequence_id=msg.sequence_id,
        positions=tuple(msg.positions),
        token_ids=tuple(msg.token_ids),
        sampling=sampling,
        history=tuple(msg.history_token_ids),
        prefix_from=msg.prefix_from,
    )


def _hidden_states(reassembler: Reassembler, piece: tensor_pb2.TensorChunk, *, whole: bool) -> torch.Tensor | None:
    """Add one chunk of a step's hidden states; the tensor once complete. `whole`: it must be."""
    tensor = reassembler.add(piece)
    if tensor is None and whole:
        reassembler.reset()
        raise FrameError(
            f"header.hidden holds {len(piece.data)} of the tensor's {piece.total_bytes} bytes: "
            "a header carries its hidden states whole, or sends them as hidden_chunk frames"
        )
    if tensor is not None and not tensor.is_floating_point():
        raise FrameError(f"hidden states have dtype {tensor.dtype}; a floating dtype is required")
    return tensor


def _incomplete(step: ReceivedStep, message: str) -> Rejected:
    return Rejected(step.header.step_id, FrameError(message))
