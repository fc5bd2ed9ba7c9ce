"""Tensor codec: bit-exact round trips for every wire dtype, and rejection of malformed frames."""

from __future__ import annotations

import tracemalloc
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from layerline.protos.v1 import tensor_pb2
from layerline.stage_worker import codec
from layerline.stage_worker.codec import CodecLimits, FrameError, FrameLimitError, Reassembler

LIMITS = CodecLimits(max_tensor_bytes=1 << 20, max_dims=6)
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as same-width integers, so NaNs and -0.0 compare exactly."""
    return t.contiguous().view(_BITS[t.dtype.itemsize])


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.is_contiguous()
    assert torch.equal(_bits(got), _bits(want))


def _random_tensor(dtype: torch.dtype, shape: list[int], seed: int) -> torch.Tensor:
    """Uniformly random bytes: every bit pattern (NaN, inf, subnormal, extremes) can occur."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """Random dtype and shape (zero-size dims included), contiguous or not."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=4))
    t = _random_tensor(dtype, shape, draw(st.integers(0, 2**31)))
    layout = draw(st.sampled_from(["contiguous", "transpose", "step", "offset", "expand"]))
    if layout == "transpose" and t.dim() >= 2:
        t = t.transpose(0, t.dim() - 1)
    elif layout == "step" and t.dim() >= 1:
        t = t[::2]
    elif layout == "offset" and t.dim() >= 1:
        t = t[1:]
    elif layout == "expand":
        t = t.unsqueeze(0).expand(3, *t.shape)
    return t


@settings(max_examples=150, deadline=None)
@given(t=tensors())
def test_encode_decode_round_trip(t: torch.Tensor) -> None:
    msg = codec.encode(t)
    assert msg.dtype == codec.dtype_to_wire(t.dtype)
    assert list(msg.shape) == list(t.shape)
    wire = tensor_pb2.Tensor.FromString(msg.SerializeToString())
    _assert_same(codec.decode(wire, limits=LIMITS), t)


@settings(max_examples=150, deadline=None)
@given(t=tensors(), chunk_bytes=st.integers(1, 400))
def test_chunk_reassemble_round_trip(t: torch.Tensor, chunk_bytes: int) -> None:
    chunks = [tensor_pb2.TensorChunk.FromString(c.SerializeToString()) for c in codec.chunk(t, chunk_bytes)]
    total = t.numel() * t.dtype.itemsize
    assert len(chunks) == max(1, -(-total // chunk_bytes))
    assert all(len(c.data) <= chunk_bytes for c in chunks)
    r = Reassembler(limits=LIMITS)
    for c in chunks[:-1]:
        assert r.add(c) is None
        assert r.in_progress
    _assert_same(r.add(chunks[-1]), t)
    assert not r.in_progress


@settings(max_examples=100, deadline=None)
@given(t=tensors(), chunk_bytes=st.integers(1, 400))
def test_a_whole_chunk_is_the_first_chunk_where_the_tensor_fits_in_one(t: torch.Tensor, chunk_bytes: int) -> None:
    into = tensor_pb2.TensorChunk()
    fits = t.numel() * t.dtype.itemsize <= chunk_bytes
    assert codec.whole_chunk(t, into, chunk_bytes) == fits
    if fits:
        assert into == next(codec.chunk(t, chunk_bytes))
        _assert_same(Reassembler(limits=LIMITS).add(tensor_pb2.TensorChunk.FromString(into.SerializeToString())), t)
    else:
        assert into == tensor_pb2.TensorChunk()  # untouched


@settings(max_examples=100, deadline=None)
@given(t=tensors(), chunk_bytes=st.integers(1, 400))
def test_a_tensors_wire_bytes_are_its_encoding_and_chunk_as_it_does(t: torch.Tensor, chunk_bytes: int) -> None:
    """What a stage's compute thread makes of its output (wire_tensor) is what the event loop sent before."""
    wire = codec.wire_tensor(t)
    assert (wire.dtype, wire.shape, wire.data) == (t.dtype, tuple(t.shape), codec.encode(t).data)
    chunks = list(codec.chunk(wire, chunk_bytes))
    assert b"".join(c.data for c in chunks) == codec.encode(t).data and all(len(c.data) <= chunk_bytes for c in chunks)
    _assert_same(wire.tensor(), t)


def test_reassembler_takes_tensor_after_tensor() -> None:
    r = Reassembler(limits=LIMITS)
    for dtype in DTYPES:
        t = _random_tensor(dtype, [3, 7], seed=1)
        out = [r.add(c) for c in codec.chunk(t, 10)]
        assert all(o is None for o in out[:-1])
        _assert_same(out[-1], t)


def test_dtype_names_are_torch_names() -> None:
    for dtype in DTYPES:
        assert "torch." + tensor_pb2.DType.Name(codec.dtype_to_wire(dtype)).lower() == str(dtype)
        assert codec.dtype_from_wire(codec.dtype_to_wire(dtype)) == dtype
    with pytest.raises(TypeError, match="float64"):
        codec.encode(torch.zeros(2, dtype=torch.float64))


def test_decoded_tensor_owns_its_memory() -> None:
    msg = codec.encode(torch.arange(6, dtype=torch.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a read-only (aliased) buffer would warn
        out = codec.decode(msg, limits=LIMITS)
    out += 100
    assert torch.equal(codec.decode(msg, limits=LIMITS), torch.arange(6, dtype=torch.float32))


def test_zero_size_tensors() -> None:
    for shape in ([0], [3, 0, 2], [0, 0]):
        t = torch.empty(shape, dtype=torch.bfloat16)
        _assert_same(codec.decode(codec.encode(t), limits=LIMITS), t)
        chunks = list(codec.chunk(t, 8))
        assert len(chunks) == 1 and chunks[0].total_bytes == 0
        _assert_same(Reassembler(limits=LIMITS).add(chunks[0]), t)
    scalar = torch.tensor(2.5, dtype=torch.bfloat16)
    _assert_same(codec.decode(codec.encode(scalar), limits=LIMITS), scalar)


def test_chunk_rejects_nonpositive_size() -> None:
    with pytest.raises(ValueError, match="max_chunk_bytes = 0"):
        next(codec.chunk(torch.zeros(2), 0))


# --- malformed whole tensors -------------------------------------------------------------------


def _tensor(dtype: int, shape: list[int], data: bytes) -> tensor_pb2.Tensor:
    return tensor_pb2.Tensor(dtype=dtype, shape=shape, data=data)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("msg", "error", "pattern"),
    [
        (_tensor(tensor_pb2.FLOAT32, [2, 3], bytes(20)), FrameError, r"tensor\.data is 20 bytes.*needs 24"),
        (_tensor(99, [2], bytes(8)), FrameError, r"tensor\.dtype = 99: unknown dtype"),
        (_tensor(tensor_pb2.DTYPE_UNSPECIFIED, [2], bytes(8)), FrameError, r"tensor\.dtype = 0: dtype must be set"),
        (_tensor(tensor_pb2.INT32, [2, -3], b""), FrameError, r"tensor\.shape\[1\] = -3: dimensions must be >= 0"),
        (
            _tensor(tensor_pb2.INT32, [1] * 7, bytes(4)),
            FrameLimitError,
            r"tensor\.shape has 7 dims: at most max_dims = 6",
        ),
        (
            _tensor(tensor_pb2.INT64, [1 << 18], bytes(8)),
            FrameLimitError,
            r"tensor\.shape .* over max_tensor_bytes = 1048576",
        ),
    ],
    ids=["bytes-vs-shape", "unknown-dtype", "unset-dtype", "negative-dim", "too-many-dims", "over-limit"],
)  # fmt: skip
def test_decode_rejects(msg: tensor_pb2.Tensor, error: type[FrameError], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        codec.decode(msg, limits=LIMITS)


def test_huge_shape_with_tiny_payload_fails_before_allocating() -> None:
    msg = _tensor(tensor_pb2.FLOAT32, [1 << 20, 1 << 20], bytes(16))  # 2**40 elements
    roomy = CodecLimits(max_tensor_bytes=1 << 62, max_dims=8)
    tracemalloc.start()
    try:
        with pytest.raises(FrameError, match=r"tensor\.data is 16 bytes.*needs 4398046511104"):
            codec.decode(msg, limits=roomy)
        with pytest.raises(FrameLimitError, match="max_tensor_bytes"):
            codec.decode(msg, limits=LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_overflowing_shape_is_exact() -> None:
    """Dims whose product overflows int64 are still rejected by exact arithmetic."""
    msg = _tensor(tensor_pb2.FLOAT32, [1 << 62, 1 << 62, 4], bytes(4))
    with pytest.raises(FrameError, match="needs 340282366920938463463374607431768211456"):
        codec.decode(msg, limits=CodecLimits(max_tensor_bytes=1 << 200, max_dims=8))


@pytest.mark.parametrize(
    "shape",
    [[1 << 62, 1 << 62, 0], [0, 1 << 40, 1 << 40], [1 << 31, 1 << 31, 4, 0], [1 << 21, 0]],
    ids=["2**62 x 2**62 x 0", "0 x 2**40 x 2**40", "2**31 x 2**31 x 4 x 0", "2**21 x 0"],
)
def test_empty_tensor_whose_other_dims_do_not_fit_is_refused(shape: list[int]) -> None:
    """0 elements and 0 bytes, but dims torch cannot build (or a real tensor could not have): refused."""
    rule = r"\.shape \[.*\] of FLOAT32 holds no elements, but its nonzero dims span \d+ bytes: over max_tensor_bytes"
    with pytest.raises(FrameLimitError, match="tensor" + rule):
        codec.decode(_tensor(tensor_pb2.FLOAT32, shape, b""), limits=LIMITS)
    r = Reassembler(limits=LIMITS)
    with pytest.raises(FrameLimitError, match="tensor_chunk" + rule):
        r.add(tensor_pb2.TensorChunk(dtype=tensor_pb2.FLOAT32, shape=shape, total_bytes=0))
    assert not r.in_progress
    if shape[0] == 1 << 62:  # a limit past what torch can index does not let it through either
        with pytest.raises(FrameLimitError, match="holds no elements"):
            codec.decode(_tensor(tensor_pb2.FLOAT32, shape, b""), limits=CodecLimits(max_tensor_bytes=1 << 200))
    # An empty tensor whose other dims fit is still a tensor, as the codec sends them.
    t = torch.empty([0, LIMITS.max_tensor_bytes // 4], dtype=torch.float32)
    _assert_same(codec.decode(codec.encode(t), limits=LIMITS), t)


def test_reassembler_checks_the_callers_expectation_before_keeping_anything() -> None:
    seen: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def expect(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        seen.append((dtype, shape))
        if shape != (4,):
            raise FrameError(f"tensor_chunk.shape = {list(shape)}: expected [4]")

    r = Reassembler(limits=LIMITS)
    with pytest.raises(FrameError, match=r"shape = \[8\]: expected \[4\]"):
        r.add(_first(total=32, shape=(8,)), expect=expect)  # only a first part of its bytes came
    assert not r.in_progress  # nothing was kept
    with pytest.raises(FrameError, match="unknown dtype"):  # the codec's own rules come first
        r.add(tensor_pb2.TensorChunk(dtype=99, shape=[4], total_bytes=16), expect=expect)  # type: ignore[arg-type]
    assert r.add(_first(), expect=expect) is None
    assert r.add(tensor_pb2.TensorChunk(offset=8, data=bytes(8)), expect=expect) is not None
    assert seen == [(torch.float32, (8,)), (torch.float32, (4,))]  # called once per tensor, at its first chunk


# --- malformed chunk sequences -----------------------------------------------------------------


def _first(total: int = 16, data: bytes = bytes(8), shape: tuple[int, ...] = (4,)) -> tensor_pb2.TensorChunk:
    return tensor_pb2.TensorChunk(
        dtype=tensor_pb2.FLOAT32, shape=list(shape), total_bytes=total, offset=0, data=data
    )  # fmt: skip


def test_chunks_out_of_order() -> None:
    r = Reassembler(limits=LIMITS)
    with pytest.raises(FrameError, match=r"tensor_chunk\.offset = 8: expected 0"):
        r.add(tensor_pb2.TensorChunk(dtype=tensor_pb2.FLOAT32, shape=[4], total_bytes=16, offset=8, data=bytes(8)))
    assert r.add(_first()) is None
    with pytest.raises(FrameError, match=r"tensor_chunk\.offset = 12: expected 8 \(chunks contiguous and in order\)"):
        r.add(tensor_pb2.TensorChunk(offset=12, data=bytes(4)))
    assert not r.in_progress  # the broken tensor is dropped; a new one can start
    assert r.add(_first()) is None
    assert r.add(tensor_pb2.TensorChunk(offset=8, data=bytes(8))) is not None


def test_chunk_overrunning_total_bytes() -> None:
    r = Reassembler(limits=LIMITS)
    assert r.add(_first()) is None
    with pytest.raises(FrameError, match=r"tensor_chunk\.data overruns total_bytes = 16: offset 8 \+ 12 bytes"):
        r.add(tensor_pb2.TensorChunk(offset=8, data=bytes(12)))
    with pytest.raises(FrameError, match="overruns total_bytes = 16: offset 0 \\+ 20 bytes"):
        r.add(_first(data=bytes(20)))


def test_chunk_total_bytes_over_limit() -> None:
    r = Reassembler(limits=LIMITS)
    with pytest.raises(FrameLimitError, match=r"tensor_chunk\.shape \[524288\] .* over max_tensor_bytes = 1048576"):
        r.add(_first(total=1 << 21, shape=(1 << 19,)))


def test_chunk_total_bytes_disagreeing_with_shape() -> None:
    with pytest.raises(FrameError, match=r"tensor_chunk\.total_bytes = 12: shape \[4\] of FLOAT32 needs 16"):
        Reassembler(limits=LIMITS).add(_first(total=12))


def test_chunk_header_fields_checked() -> None:
    r = Reassembler(limits=LIMITS)
    with pytest.raises(FrameError, match=r"tensor_chunk\.dtype = 99: unknown dtype"):
        r.add(tensor_pb2.TensorChunk(dtype=99, shape=[1], total_bytes=4, data=bytes(4)))  # type: ignore[arg-type]
    with pytest.raises(FrameError, match=r"tensor_chunk\.shape\[0\] = -1: dimensions must be >= 0"):
        r.add(_first(shape=(-1,)))
    assert r.add(_first()) is None
    with pytest.raises(FrameError, match=r"tensor_chunk\.shape = \[2\] at offset 8: differs"):
        r.add(tensor_pb2.TensorChunk(shape=[2], offset=8, data=bytes(8)))
    assert r.add(_first()) is None
    with pytest.raises(FrameError, match=r"tensor_chunk\.data is empty at offset 8"):
        r.add(tensor_pb2.TensorChunk(offset=8))
