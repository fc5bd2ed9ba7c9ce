"""Fuzzing what a stage accepts from the network: tensor frames (codec) and Step frames (frames).

Property-based (hypothesis), over more than 10,000 cases per run, derandomized so that CI sees
the same cases each time. Inputs come both from random fields (shapes, dtypes, sizes, lengths
around each bound) and from the serialized bytes of valid frames, mutated, then parsed with
`FromString` where they still parse. The property: every input is decoded (a tensor, a step) or
refused with an `InvalidInput` (FrameError, StepInputError), never another exception; every step
begun on a stream is answered; no case takes long; and the memory a decode allocates (traced by
`tracemalloc`) stays within a small multiple of `max_tensor_bytes` plus the input's own size.
Hypothesis draws each case's structure and a seed; its bulk comes from `random.Random(seed)`.
"""

from __future__ import annotations

import math
import random
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import torch
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerline.protos.v1 import stage_pb2, tensor_pb2
from layerline.shared.errors import InvalidInput
from layerline.shared.model_config import LayerRange
from layerline.shared.settings import TelemetrySettings
from layerline.shared.telemetry import Telemetry
from layerline.stage_worker import codec
from layerline.stage_worker.codec import CodecLimits, FrameError, Reassembler
from layerline.stage_worker.frames import Pushed, StepAssembler, StepRules
from layerline.stage_worker.step_telemetry import StageTelemetry

LIMITS = CodecLimits(max_tensor_bytes=4096, max_dims=4)
HIDDEN = 4
MODEL = "m"
SLACK = 16 << 10  # Python's own objects around a decode: exceptions, messages, small tuples
CASE_SECONDS = 5.0  # a case taking longer is a hang, not a slow machine
CASES: Counter[str] = Counter()  # cases run to their end, by test; "peak": the most a decode allocated past its input
FUZZ_TESTS = 5
T = TypeVar("T")
CHECKS = list(HealthCheck)  # none: the cases are large and slow on purpose

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32]
WIRE_DTYPES = [codec.dtype_to_wire(d) for d in DTYPES]
EDGES = [-(2**63), -(2**31), -1, 2**31 - 1, 2**31, 2**32, 2**40, 2**62, 2**63 - 1]
NAMES = ["", "a", "b", MODEL, "x" * 12, "x" * 13, "é" * 6, "é" * 7, "k" * 16, "k" * 17]  # bounds: 12 and 16 bytes
LETTERS = "ab xyzé€\U0001d11e\x00"


def fuzz(cases: int) -> settings:
    """`cases` examples, the same ones on every run (derandomized), none of them timed by hypothesis."""
    return settings(max_examples=cases, deadline=None, derandomize=True, database=None, suppress_health_check=CHECKS)


@pytest.fixture(scope="module", autouse=True)
def counted(request: pytest.FixtureRequest) -> Iterator[None]:
    """At the module's end, the count of cases run (printed, and checked when every test ran)."""
    started = time.perf_counter()
    yield
    peak = CASES.pop("peak", 0)
    total = sum(CASES.values())
    each = ", ".join(f"{name} {n}" for name, n in CASES.items())
    line = f"fuzz: {total} cases in {time.perf_counter() - started:.1f}s ({each}); peak past the input {peak} bytes"
    report, capture = (request.config.pluginmanager.get_plugin(name) for name in ("terminalreporter", "capturemanager"))
    if report is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            report.write_line(line)
    if len(CASES) == FUZZ_TESTS:
        assert total >= 10_000, line


def measured(run: Callable[[], T], *, input_bytes: int) -> T:
    """`run()`, failing the case if it allocated past the bound or took too long. Memory is traced
    only meanwhile (tracing hypothesis's own work too would take most of the run)."""
    tracemalloc.start()
    started = time.perf_counter()
    try:
        return run()
    finally:
        took = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        CASES["peak"] = max(CASES["peak"], peak - 2 * input_bytes)
        assert peak <= 4 * LIMITS.max_tensor_bytes + 2 * input_bytes + SLACK, (peak, input_bytes)
        assert took < CASE_SECONDS, took


def parsed(cls: type[Message], raw: bytes) -> Message | None:
    """What a server hands on: the message, or None where it does not decode (INVALID_ARGUMENT there)."""
    try:
        return cls.FromString(raw)
    except DecodeError:
        return None


# --- random pieces, from a seeded Random ------------------------------------------------------


def dim(rng: random.Random) -> int:
    return rng.choice([0, rng.randrange(7), rng.randrange(-3, 4096), rng.choice(EDGES)])


def wire_dtype(rng: random.Random) -> int:
    return rng.choice([*WIRE_DTYPES, 0, 6, 99, -1, 2**31 - 1])


def text(rng: random.Random) -> str:
    """Mostly names at and around the bounds, sometimes any short text."""
    if rng.random() < 0.7:
        return rng.choice(NAMES)
    return "".join(rng.choice(LETTERS) for _ in range(rng.randrange(21)))


def tensor(rng: random.Random, shape: tuple[int, ...] | None = None, *, floating: bool = False) -> torch.Tensor:
    """A small tensor of random bits (NaNs, infinities and all)."""
    dtype = rng.choice(DTYPES[:3] if floating else DTYPES)
    if shape is None:
        shape = tuple(rng.randrange(7) for _ in range(rng.randrange(4)))
    numel = math.prod(shape)
    raw = torch.frombuffer(bytearray(rng.randbytes(numel * dtype.itemsize)) or bytearray(1), dtype=torch.uint8)
    return raw[: numel * dtype.itemsize].view(dtype).reshape(shape)


def chunks_of(rng: random.Random, t: torch.Tensor) -> list[tensor_pb2.TensorChunk]:
    """`t` in 1 to 8 chunks."""
    nbytes = max(1, t.numel() * t.element_size())
    return list(codec.chunk(t, rng.randint(-(-nbytes // 8), nbytes)))


def random_chunk(rng: random.Random) -> tensor_pb2.TensorChunk:
    """A chunk of fields drawn independently, or of a tensor with no elements (and any other dims)."""
    if rng.random() < 0.2:
        shape = [dim(rng) for _ in range(rng.randrange(1, 5))]
        shape[rng.randrange(len(shape))] = 0
        return tensor_pb2.TensorChunk(dtype=wire_dtype(rng), shape=shape)
    return tensor_pb2.TensorChunk(
        dtype=wire_dtype(rng),
        shape=[dim(rng) for _ in range(rng.randrange(7))],
        total_bytes=rng.choice([rng.randrange(-4, 257), rng.choice(EDGES)]),
        offset=rng.choice([0, rng.randrange(-4, 257), rng.choice(EDGES)]),
        data=rng.randbytes(rng.randrange(301)),
    )


MUTATIONS = ["dtype", "shape", "dim", "total", "offset", "data", "drop", "repeat", "swap"]


def mutate_field(rng: random.Random, what: str, msg: tensor_pb2.Tensor | tensor_pb2.TensorChunk) -> None:
    """One field of a Tensor or TensorChunk changed: dtype, shape, one dim, data (a chunk's: total, offset)."""
    if what == "dtype":
        msg.dtype = wire_dtype(rng)
    elif what == "shape" or (what == "dim" and not msg.shape):
        msg.shape[:] = [dim(rng) for _ in range(rng.randrange(7))]
    elif what == "dim":
        msg.shape[rng.randrange(len(msg.shape))] = dim(rng)
    elif what == "data":
        msg.data = msg.data[: rng.randint(0, len(msg.data))] + rng.randbytes(rng.randrange(17))
    elif what == "total" and isinstance(msg, tensor_pb2.TensorChunk):
        msg.total_bytes = rng.choice([msg.total_bytes + rng.randint(-8, 8), rng.choice(EDGES)])
    elif what == "offset" and isinstance(msg, tensor_pb2.TensorChunk):
        msg.offset = rng.choice([msg.offset + rng.randint(-8, 8), rng.choice(EDGES)])


def mutate(rng: random.Random, what: str, chunks: list[tensor_pb2.TensorChunk]) -> list[tensor_pb2.TensorChunk]:
    """The chunks of a valid tensor with one thing changed: a field, or a chunk dropped, repeated, swapped."""
    chunks = [tensor_pb2.TensorChunk.FromString(c.SerializeToString()) for c in chunks]
    i, j = rng.randrange(len(chunks)), rng.randrange(len(chunks))
    if what == "drop" and len(chunks) > 1:
        del chunks[i]
    elif what == "repeat":
        chunks.insert(i, chunks[i])
    elif what == "swap":
        chunks[i], chunks[j] = chunks[j], chunks[i]
    else:
        mutate_field(rng, what, chunks[i])
    return chunks


def mutate_bytes(rng: random.Random, raw: bytes) -> bytes:
    """`raw` with 1 to 4 edits: a bit flipped, a byte set, bytes inserted, deleted, cut off or repeated."""
    data = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        op = rng.choice(["flip", "set", "insert", "delete", "truncate", "repeat"])
        at = rng.randint(0, len(data))
        if op == "flip" and at < len(data):
            data[at] ^= 1 << rng.randrange(8)
        elif op == "set" and at < len(data):
            data[at] = rng.choice([0x00, 0x7F, 0x80, 0xFF, 0x0A, 0x12, 0x1A, 0x08])
        elif op == "insert":
            data[at:at] = rng.randbytes(rng.randrange(9))
        elif op == "delete":
            del data[at : at + rng.randint(1, 8)]
        elif op == "truncate":
            del data[at:]
        elif op == "repeat":
            data[at:at] = data[at : at + rng.randint(1, 32)]
    return bytes(data)


Run = tuple[torch.Tensor | None, list[tensor_pb2.TensorChunk]]


@st.composite
def chunk_runs(draw: st.DrawFn, shape: tuple[int, ...] | None = None) -> Run:
    """(the tensor, its chunks) for a valid run, else (None, chunks that may be anything)."""
    kind = draw(st.sampled_from(["valid", "random", *MUTATIONS]))
    rng = random.Random(draw(st.integers(0, 2**32)))
    if kind == "random":
        return None, [random_chunk(rng) for _ in range(rng.randint(1, 4))]
    t = tensor(rng, shape, floating=shape is not None and rng.random() < 0.9)
    chunks = chunks_of(rng, t)
    return (t, chunks) if kind == "valid" else (None, mutate(rng, kind, chunks))


# --- the tensor codec --------------------------------------------------------------------------


def check_decode(msg: tensor_pb2.Tensor) -> None:
    try:
        t = measured(lambda: codec.decode(msg, limits=LIMITS), input_bytes=msg.ByteSize())
    except FrameError:
        return
    assert tuple(t.shape) == tuple(msg.shape) and t.dtype == codec.dtype_from_wire(msg.dtype)
    assert t.numel() * t.element_size() == len(msg.data) <= LIMITS.max_tensor_bytes


@st.composite
def tensor_messages(draw: st.DrawFn) -> tensor_pb2.Tensor:
    rng = random.Random(draw(st.integers(0, 2**32)))
    kind = draw(st.sampled_from(["valid", "dtype", "shape", "dim", "data", "fields"]))
    if kind == "fields":
        c = random_chunk(rng)
        return tensor_pb2.Tensor(dtype=c.dtype, shape=c.shape, data=c.data)
    msg = codec.encode(tensor(rng))
    mutate_field(rng, kind, msg)
    return msg


@fuzz(2500)
@given(tensor_messages())
def test_decode_takes_any_tensor_message(msg: tensor_pb2.Tensor) -> None:
    check_decode(msg)
    CASES["decode"] += 1


def feed(r: Reassembler, chunks: list[tensor_pb2.TensorChunk]) -> list[torch.Tensor | FrameError]:
    out: list[torch.Tensor | FrameError] = []
    for c in chunks:
        try:
            t = measured(lambda c=c: r.add(c), input_bytes=c.ByteSize())
        except FrameError as err:
            assert not r.in_progress  # a broken tensor is dropped whole
            out.append(err)
            continue
        if t is not None:
            assert t.numel() * t.element_size() <= LIMITS.max_tensor_bytes
            out.append(t)
    return out


@fuzz(2500)
@given(chunk_runs())
def test_reassembler_takes_any_run_of_chunks(run: Run) -> None:
    t, chunks = run
    out = feed(Reassembler(limits=LIMITS), chunks)
    if t is not None:  # a valid run comes back bit for bit
        assert len(out) == 1 and isinstance(out[0], torch.Tensor) and out[0].dtype == t.dtype
        assert torch.equal(out[0].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
    CASES["reassemble"] += 1


@fuzz(1500)
@given(st.integers(0, 2**32))
def test_tensor_frames_from_mutated_bytes(seed: int) -> None:
    rng = random.Random(seed)
    t = tensor(rng)
    if (msg := parsed(tensor_pb2.Tensor, mutate_bytes(rng, codec.encode(t).SerializeToString()))) is not None:
        check_decode(msg)
    raw = [c.SerializeToString() for c in chunks_of(rng, t)]
    raw = [mutate_bytes(rng, r) if rng.random() < 0.5 else r for r in raw]
    feed(Reassembler(limits=LIMITS), [c for r in raw if (c := parsed(tensor_pb2.TensorChunk, r)) is not None])
    CASES["tensor bytes"] += 1


# --- Step frames -------------------------------------------------------------------------------

RULES = {
    where: StepRules(
        model_id=MODEL,
        layers=LayerRange(0 if where == "first" else 2, 4 if where == "last" else 2),
        is_first=where == "first",
        is_last=where == "last",
        max_sequences=3,
        hidden_size=HIDDEN,
        max_step_tokens=12,
        max_history=16,
        max_route_hops=3,
        max_id_bytes=12,
        max_trace_entries=2,
        max_trace_bytes=16,
    )
    for where in ("first", "middle", "last")
}
TELEMETRY = StageTelemetry.of(Telemetry(TelemetrySettings(), service="fuzz"), layers="2:4", kv_blocks=lambda: (0, 0))


def near(rng: random.Random, bound: int) -> int:
    """A length around `bound`: mostly within it, sometimes just past it."""
    return rng.randint(0, bound) if rng.random() < 0.8 else rng.randint(bound, bound + 2)


def sequence(rng: random.Random) -> stage_pb2.SequenceInput:
    n = near(rng, 6)
    first = rng.choice([rng.randrange(301), rng.choice(EDGES)])
    positions = [min(first + i, 2**63 - 1) for i in range(n)]  # consecutive, or piled up at the top
    if positions and rng.random() < 0.3:
        positions[rng.randrange(n)] = rng.choice(EDGES)
    return stage_pb2.SequenceInput(
        sequence_id=text(rng),
        positions=positions,
        token_ids=[rng.randrange(-5, 300) for _ in range(near(rng, n))],
        sample=rng.random() < 0.5,
        history_token_ids=list(range(near(rng, 16))),
        trace_context={text(rng): text(rng) for _ in range(near(rng, 2))},
        prefix_from=text(rng) if rng.random() < 0.3 else "",
    )


@st.composite
def step_frames(draw: st.DrawFn, step_id: int) -> list[stage_pb2.StepFrame]:
    """One step's frames: its header, then its chunks (if any)."""
    rng = random.Random(draw(st.integers(0, 2**32)))
    seqs = [sequence(rng) for _ in range(draw(st.integers(0, 4)))]
    header = stage_pb2.StepHeader(
        step_id=step_id,
        model_id=MODEL if rng.random() < 0.8 else text(rng),
        sequences=seqs,
        route=["127.0.0.1:1"] * near(rng, 3),
        chain=["127.0.0.1:1"] * near(rng, 3),
        release_sequence_ids=[text(rng) for _ in range(near(rng, 3))],
        alone=rng.random() < 0.5,
    )
    tokens = sum(len(s.positions) for s in seqs)
    _, chunks = draw(chunk_runs(shape=(tokens, HIDDEN) if draw(st.booleans()) else None))
    where = draw(st.sampled_from(["chunks", "chunks", "header", "none"]))
    if where == "header":
        header.hidden.CopyFrom(chunks[0])
        chunks = chunks[1:]
    elif where == "none":
        chunks = []
    return [stage_pb2.StepFrame(header=header), *(stage_pb2.StepFrame(hidden_chunk=c) for c in chunks)]


def check_stream(rules: StepRules, frames: list[stage_pb2.StepFrame]) -> None:
    """Push every frame, then end: each step begun is answered once, by an error or as a step."""
    a = StepAssembler(rules, codec=LIMITS, telemetry=TELEMETRY.stream())
    pushes: list[Pushed] = [measured(lambda f=f: a.push(f), input_bytes=f.ByteSize()) for f in frames]
    pushes.append(a.end())
    assert sum(p.arrived for p in pushes) == sum(len(p.rejected) + len(p.steps) for p in pushes), pushes
    for p in pushes:
        for rejected in p.rejected:
            assert isinstance(rejected.error, InvalidInput), rejected.error
        for step in p.steps:
            tokens = sum(s.num_tokens for s in step.seqs)
            assert step.header.model_id == MODEL and tokens <= rules.max_step_tokens, step.header
            assert len(step.seqs) <= rules.max_sequences and all(len(s.sequence_id.encode()) <= 12 for s in step.seqs)
            shape = None if step.hidden is None else tuple(step.hidden.shape)  # [tokens, hidden], but on a first stage
            assert shape == (None if rules.is_first else (tokens, rules.hidden_size))
            assert step.hidden is None or step.hidden.is_floating_point()


@fuzz(2500)
@given(st.sampled_from(list(RULES)), st.data())
def test_step_assembler_takes_any_frames(where: str, data: st.DataObject) -> None:
    frames: list[stage_pb2.StepFrame] = []
    for step_id in range(1, data.draw(st.integers(1, 3)) + 1):
        frames += data.draw(step_frames(step_id))
    strays = [stage_pb2.StepFrame(), stage_pb2.StepFrame(hidden_chunk=random_chunk(random.Random(len(frames))))]
    if (stray := data.draw(st.sampled_from([None, *strays]))) is not None:  # an empty frame, a chunk none is due
        frames.insert(data.draw(st.integers(0, len(frames))), stray)
    check_stream(RULES[where], frames)
    CASES["step frames"] += 1


@fuzz(2000)
@given(st.sampled_from(list(RULES)), step_frames(1), st.integers(0, 2**32))
def test_step_assembler_takes_mutated_bytes(where: str, frames: list[stage_pb2.StepFrame], seed: int) -> None:
    rng = random.Random(seed)
    raw = [f.SerializeToString() for f in frames]
    raw = [mutate_bytes(rng, r) if rng.random() < 0.7 else r for r in raw]
    check_stream(RULES[where], [f for r in raw if (f := parsed(stage_pb2.StepFrame, r)) is not None])
    CASES["step bytes"] += 1
