"""What a stage takes from the network, frame by frame, in process.

A message that does not decode is refused by the service wrapper (`shared.services`) on a real
`grpc.aio` server; one that does becomes a step in the StepAssembler: what it refuses, with which
words, and that it refuses before it builds anything from the claim (a long list, a large tensor).
"""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
import torch

from layerline.protos.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2
from layerline.shared.errors import InvalidInput, OverLimit
from layerline.shared.model_config import LayerRange
from layerline.shared.services import add_servicer
from layerline.shared.settings import TelemetrySettings
from layerline.shared.telemetry import Telemetry
from layerline.stage_worker.codec import CodecLimits, FrameError, chunk
from layerline.stage_worker.engine import StepInputError
from layerline.stage_worker.frames import Pushed, StepAssembler, StepRules
from layerline.stage_worker.step_telemetry import StageTelemetry

MODEL = "m0del"
HIDDEN = 8
LIMITS = CodecLimits(max_tensor_bytes=1 << 16)


def rules(*, first: bool = False, last: bool = True) -> StepRules:
    return StepRules(
        model_id=MODEL,
        layers=LayerRange(0 if first else 2, 4 if last else 2),
        is_first=first,
        is_last=last,
        max_sequences=4,
        hidden_size=HIDDEN,
        max_step_tokens=32,
        max_history=64,
    )


def assembler(*, first: bool = False, last: bool = True) -> StepAssembler:
    telemetry = StageTelemetry.of(
        Telemetry(TelemetrySettings(), service="test"), layers="2:4", kv_blocks=lambda: (0, 0)
    )
    return StepAssembler(rules(first=first, last=last), codec=LIMITS, telemetry=telemetry.stream())


def seq(sid: str, positions: range | list[int], **fields: object) -> stage_pb2.SequenceInput:
    return stage_pb2.SequenceInput(sequence_id=sid, positions=list(positions), **fields)  # type: ignore[arg-type]


def header(*seqs: stage_pb2.SequenceInput, step_id: int = 1, **fields: object) -> stage_pb2.StepFrame:
    fields.setdefault("model_id", MODEL)
    return stage_pb2.StepFrame(header=stage_pb2.StepHeader(step_id=step_id, sequences=list(seqs), **fields))  # type: ignore[arg-type]


def piece(c: tensor_pb2.TensorChunk) -> stage_pb2.StepFrame:
    return stage_pb2.StepFrame(hidden_chunk=c)


def refused(pushed: Pushed) -> str:
    """The one error `pushed` answered with (and nothing else)."""
    assert not pushed.steps and len(pushed.rejected) == 1, pushed
    error = pushed.rejected[0].error
    assert isinstance(error, InvalidInput)
    return str(error)


def test_a_step_in_chunks_and_a_step_in_its_header() -> None:
    a = assembler()
    hidden = torch.randn(5, HIDDEN)
    assert a.push(header(seq("a", range(3)), seq("b", [7, 8]))).arrived == 1
    pieces = [a.push(piece(c)) for c in chunk(hidden, 48)]
    assert all(not p.steps and not p.rejected for p in pieces[:-1])
    (step,) = pieces[-1].steps
    assert torch.equal(step.hidden, hidden) and [s.sequence_id for s in step.seqs] == ["a", "b"]
    frame = header(seq("c", [0]), step_id=2)
    frame.header.hidden.CopyFrom(next(chunk(hidden[:1], 1 << 20)))
    (step,) = a.push(frame).steps
    assert step.hidden.shape == (1, HIDDEN)


# --- hidden states: the declared shape and dtype, at the first chunk -------------------------


def test_a_shape_other_than_the_steps_is_refused_at_the_first_chunk() -> None:
    a = assembler()
    a.push(header(seq("a", range(2))))
    first = next(chunk(torch.zeros(3, HIDDEN), 16))  # 16 of its 96 bytes: nothing else has come
    message = refused(a.push(piece(first)))
    assert (
        message
        == f"hidden_chunk.shape = [3, {HIDDEN}]: the step's 2 positions need [2, {HIDDEN}] (tokens x hidden_size)"
    )
    assert a.push(piece(tensor_pb2.TensorChunk(offset=16, data=bytes(16)))).rejected == []  # the rest is skipped
    assert a.push(header(seq("a", [0]), step_id=2)).rejected == []  # and the stream goes on


def test_a_large_claim_is_refused_before_its_bytes_are_kept() -> None:
    a = assembler()
    a.push(header(seq("a", range(2))))
    claim = tensor_pb2.TensorChunk(
        dtype=tensor_pb2.FLOAT32, shape=[2000, HIDDEN], total_bytes=2000 * HIDDEN * 4, data=bytes(4096)
    )  # within max_tensor_bytes, but not the step's
    tracemalloc.start()
    try:
        message = refused(a.push(piece(claim)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert f"hidden_chunk.shape = [2000, {HIDDEN}]" in message and f"need [2, {HIDDEN}]" in message
    assert peak < 64 << 10


@pytest.mark.parametrize("dtype", [tensor_pb2.INT64, tensor_pb2.INT32])
def test_integer_hidden_states_are_refused_at_the_first_chunk(dtype: int) -> None:
    a = assembler()
    a.push(header(seq("a", range(2))))
    size = 8 if dtype == tensor_pb2.INT64 else 4
    first = tensor_pb2.TensorChunk(dtype=dtype, shape=[2, HIDDEN], total_bytes=2 * HIDDEN * size, data=bytes(8))  # type: ignore[arg-type]
    name = tensor_pb2.DType.Name(dtype)
    assert refused(a.push(piece(first))) == (
        f"hidden_chunk.dtype is {name}: hidden states need a floating dtype (FLOAT32, BFLOAT16 or FLOAT16)"
    )


def test_hidden_states_in_the_header_are_checked_alike() -> None:
    a = assembler()
    frame = header(seq("a", range(2)))
    frame.header.hidden.CopyFrom(next(chunk(torch.zeros(1, HIDDEN), 1 << 20)))
    assert refused(a.push(frame)).startswith(f"header.hidden.shape = [1, {HIDDEN}]: the step's 2 positions need")
    first = assembler(first=True, last=False)
    frame = header(seq("a", [0], token_ids=[1]), route=["127.0.0.1:1"])
    frame.header.hidden.CopyFrom(next(chunk(torch.zeros(1, HIDDEN), 1 << 20)))
    assert "the first stage takes token ids, not hidden states" in refused(first.push(frame))


# --- header lengths, checked before anything is built from them -----------------------------

LONG = "x" * 129  # one byte past max_id_bytes
HOSTILE: dict[str, tuple[stage_pb2.StepFrame, str]] = {  # name -> (frame, words of the error)
    "no model_id": (header(seq("a", [0]), model_id=""), "model_id is empty: a step names the model it was routed for"),
    "another model": (header(seq("a", [0]), model_id="other"), "model_id 'other' differs from this stage's 'm0del'"),
    "a long model_id": (
        header(seq("a", [0]), model_id="m" * 10_000),
        "model_id is 10000 bytes: at most max_id_bytes = 128",
    ),
    "5 sequences": (
        header(*(seq(f"s{i}", [0]) for i in range(5))),
        "sequences holds 5 entries: at most max_sequences = 4",
    ),
    "33 positions": (
        header(seq("a", range(20)), seq("b", range(13))),
        "sequences[1].positions brings the step to 33 positions: at most max_step_tokens = 32",
    ),
    "token ids past positions": (
        header(seq("a", [0, 1], token_ids=[1, 2, 3])),
        "sequences[0].token_ids holds 3 ids for 2 positions: at most one per position",
    ),
    "a history past the context": (
        header(seq("a", [0], history_token_ids=range(65))),
        "sequences[0].history_token_ids holds 65 ids: at most max_history = 64",
    ),
    "65 hops": (header(seq("a", [0]), route=["h:1"] * 65), "route holds 65 entries: at most max_route_hops = 64"),
    "65 released ids": (
        header(seq("a", [0]), release_sequence_ids=[f"r{i}" for i in range(5)]),
        "release_sequence_ids holds 5 entries: at most max_sequences = 4",
    ),
    "9 trace entries": (
        header(seq("a", [0], trace_context={f"k{i}": "v" for i in range(9)})),
        "sequences[0].trace_context holds 9 entries: at most max_trace_entries = 8",
    ),
    "a long trace value": (
        header(seq("a", [0], trace_context={"tracestate": "v" * 513})),
        "sequences[0].trace_context['tracestate'] is 513 bytes: at most max_trace_bytes = 512",
    ),
    "a long trace key": (
        header(seq("a", [0], trace_context={"k" * 513: "v"})),
        "sequences[0].trace_context key is 513 bytes: at most max_trace_bytes = 512",
    ),
    "a long sequence_id": (header(seq(LONG, [0])), "sequences[0].sequence_id is 129 bytes: at most max_id_bytes = 128"),
    "a long prefix_from": (
        header(seq("a", [3], prefix_from="é" * 65)),
        "sequences[0].prefix_from is 130 bytes: at most max_id_bytes = 128",
    ),
    "a long subscriber": (
        header(seq("a", [0]), reply=stage_pb2.DirectReply(subscriber="s" * 200, step_id=3)),
        "reply.subscriber is 200 bytes: at most max_id_bytes = 128",
    ),
    "a long released id": (
        header(seq("a", [0]), release_sequence_ids=["r", LONG]),
        "release_sequence_ids[1] is 129 bytes: at most max_id_bytes = 128",
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_header_lengths_are_bounded(name: str) -> None:
    frame, words = HOSTILE[name]
    a = assembler()
    pushed = a.push(frame)
    message = refused(pushed)
    assert words in message, message
    assert len(message) < 300  # what the caller sent is never echoed whole
    assert a.push(header(seq("ok", [0]), step_id=9)).rejected == []  # the stream goes on


def test_a_route_past_the_limit_is_refused_on_a_middle_stage() -> None:
    a = assembler(last=False)
    message = refused(a.push(header(seq("a", [0]), route=["h:1"] * 65)))
    assert message == "route holds 65 entries: at most max_route_hops = 64"
    assert isinstance(a.push(header(seq("a", [0]), route=["h:1"] * 65)).rejected[0].error, OverLimit)


def test_four_million_positions_are_refused_without_building_them() -> None:
    """A 30 MiB header: its lengths are read in O(1) each, and nothing is built from it."""
    frame = header(seq("a", range(4_000_000), token_ids=range(4_000_000)))
    a = assembler()
    started = time.perf_counter()
    message = refused(a.push(frame))
    took = time.perf_counter() - started
    assert "sequences[0].positions brings the step to 4000000 positions: at most max_step_tokens = 32" in message
    assert took < 0.1, took


def test_errors_are_the_kinds_that_answer_invalid_argument() -> None:
    a = assembler()
    a.push(header(seq("a", [0])))
    bad = a.push(piece(tensor_pb2.TensorChunk(dtype=tensor_pb2.INT64, shape=[1, HIDDEN], total_bytes=64)))
    assert isinstance(bad.rejected[0].error, FrameError)
    assert isinstance(assembler().push(header(seq("a", [0]), model_id="")).rejected[0].error, StepInputError)


# --- messages that do not decode (layerline.shared.services) --------------------------------


class FakeStage(stage_pb2_grpc.StageWorkerServicer):
    """Answers from the requests alone; leaves Info to the generated base (UNIMPLEMENTED)."""

    async def Step(self, request_iterator: AsyncIterator[stage_pb2.StepFrame], context: Any) -> AsyncIterator[Any]:
        async for frame in request_iterator:
            yield stage_pb2.StepResult(step_id=frame.header.step_id)

    async def Release(self, request: stage_pb2.ReleaseRequest, context: Any) -> stage_pb2.ReleaseResponse:
        return stage_pb2.ReleaseResponse(released=len(request.sequence_ids))

    async def Results(self, request: stage_pb2.ResultsRequest, context: Any) -> AsyncIterator[Any]:
        yield stage_pb2.StepResult(step_id=len(request.subscriber))


GARBAGE = b"\x0a\xff\xff\xff\xff"  # field 1, length-delimited, with a length past the end


async def raw_calls() -> dict[str, tuple[grpc.StatusCode, str]]:
    """Each StageWorker method of a FakeStage served by `add_servicer`, called with raw bytes."""
    server = grpc.aio.server()
    add_servicer(server, FakeStage(), stage_pb2.DESCRIPTOR.services_by_name["StageWorker"])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    got: dict[str, tuple[grpc.StatusCode, str]] = {}

    async def outcome(name: str, call: Callable[[], Awaitable[Any]]) -> None:
        try:
            got[name] = (grpc.StatusCode.OK, str(await call()))
        except grpc.aio.AioRpcError as err:
            got[name] = (err.code(), err.details() or "")

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:

            def method(kind: Callable[..., Any], name: str, reply: type[Any]) -> Any:
                return kind(
                    f"/layerline.v1.StageWorker/{name}",
                    request_serializer=bytes,
                    response_deserializer=reply.FromString,
                )

            release = method(channel.unary_unary, "Release", stage_pb2.ReleaseResponse)
            info = method(channel.unary_unary, "Info", stage_pb2.InfoResponse)
            results = method(channel.unary_stream, "Results", stage_pb2.StepResult)
            ok = stage_pb2.ReleaseRequest(sequence_ids=["a", "b"]).SerializeToString()
            await outcome("Release ok", lambda: release(ok))
            await outcome(
                "Results ok", lambda: results(stage_pb2.ResultsRequest(subscriber="sub").SerializeToString()).read()
            )
            await outcome("Info ok", lambda: info(b""))
            await outcome("Release", lambda: release(GARBAGE))
            await outcome("Info", lambda: info(GARBAGE))
            await outcome("Results", lambda: results(GARBAGE).read())
            step = method(channel.stream_stream, "Step", stage_pb2.StepResult)()
            await step.write(stage_pb2.StepFrame(header=stage_pb2.StepHeader(step_id=41)).SerializeToString())
            await outcome("Step ok", step.read)
            await step.write(GARBAGE)  # the second message of the stream does not decode
            await outcome("Step", step.read)
    finally:
        await server.stop(None)
    return got


def test_messages_that_do_not_decode_are_invalid_argument() -> None:
    got = asyncio.run(raw_calls())
    assert got.pop("Release ok") == (grpc.StatusCode.OK, "released: 2\n")
    assert got.pop("Results ok") == (grpc.StatusCode.OK, "step_id: 3\n")
    assert got.pop("Step ok") == (grpc.StatusCode.OK, "step_id: 41\n")
    assert got.pop("Info ok")[0] == grpc.StatusCode.UNIMPLEMENTED  # what the servicer does not serve, as before
    for name, message in [
        ("Release", "ReleaseRequest"),
        ("Info", "InfoRequest"),
        ("Results", "ResultsRequest"),
        ("Step", "StepFrame"),
    ]:
        code, details = got[name]
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
        assert details.startswith(
            f"/layerline.v1.StageWorker/{name}: a request message does not decode as layerline.v1.{message} ("
        )
