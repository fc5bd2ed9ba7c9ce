"""Tensors to wire frames and back: the only module that touches tensor bytes.

Owns the mapping between torch tensors and the `Tensor` / `TensorChunk` messages of
`layerline/protos/v1/tensor.proto`: a dtype enum, a shape and raw little-endian bytes. Every frame
from the network is validated before anything is allocated: a known dtype, at most
`CodecLimits.max_dims` dims, every dim >= 0, element count times item size (computed with Python
ints, so a huge shape cannot overflow) equal to the byte length and within
`CodecLimits.max_tensor_bytes`, the same bound on a tensor with no elements counting its 0 dims as
1 (so that every shape that passes is one torch can build), and chunks contiguous and in order.
A caller that knows what the next tensor must be (`Reassembler.add(..., expect=)`) has it checked
at the first chunk, before anything is kept. A `WireTensor` is a tensor as its wire bytes, on either side: a
stage makes the bytes it sends on its compute thread (`wire_tensor`) and the tensor of the bytes
it received there too (`WireTensor.tensor`), so that no torch call runs on the event loop between
two steps: there, after a step has streamed the weights through the caches, one row's reassembly
into a tensor took about 150 us, and its bytes by way of numpy 129. A bad frame raises
`FrameError` (or its subclass `FrameLimitError` for a breached limit) whose message names the
field and the rule. Nothing is pickled or `torch.load`ed, and decoded tensors own their memory
(they never alias the protobuf's bytes).

Must not know: what the tensors mean (hidden states, ids), models, KV caches, gRPC, steps.
The wire is little-endian; like torch's own serialization this module runs only on
little-endian hosts.
"""

from __future__ import annotations

import ctypes
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from layerline.protos.v1 import tensor_pb2
from layerline.shared.errors import InvalidInput, OverLimit

if sys.byteorder != "little":
    raise ImportError("the tensor codec needs a little-endian host: the wire is little-endian")


@dataclass(frozen=True)
class CodecLimits:
    """What a received tensor may be at most."""

    max_tensor_bytes: int = 1 << 30  # bytes of one tensor's data (whole or summed over its chunks)
    max_dims: int = 8  # number of dimensions of one tensor

    def __post_init__(self) -> None:
        if self.max_tensor_bytes < 0:
            raise ValueError(f"CodecLimits.max_tensor_bytes = {self.max_tensor_bytes}: must be >= 0")
        if self.max_dims < 0:
            raise ValueError(f"CodecLimits.max_dims = {self.max_dims}: must be >= 0")


class FrameError(InvalidInput):
    """A tensor frame from the network is malformed (INVALID_ARGUMENT)."""


class FrameLimitError(FrameError, OverLimit):
    """A tensor frame is well-formed but breaches a CodecLimits bound (INVALID_ARGUMENT, too)."""


_TORCH_DTYPE: dict[tensor_pb2.DType, torch.dtype] = {
    tensor_pb2.FLOAT32: torch.float32,
    tensor_pb2.BFLOAT16: torch.bfloat16,
    tensor_pb2.FLOAT16: torch.float16,
    tensor_pb2.INT64: torch.int64,
    tensor_pb2.INT32: torch.int32,
}
_WIRE_DTYPE: dict[torch.dtype, tensor_pb2.DType] = {dt: wire for wire, dt in _TORCH_DTYPE.items()}
_MAX_STRING_AT = (1 << 31) - 1  # ctypes.string_at takes its size as a C int
_MAX_SPAN_BYTES = 1 << 62  # torch's sizes and strides are int64: no shape may span more, whatever the limit

# A check of the next tensor's dtype and shape by a caller that knows what they must be (raises FrameError).
Expect = Callable[[torch.dtype, tuple[int, ...]], None]


def dtype_to_wire(dtype: torch.dtype) -> tensor_pb2.DType:
    """The `DType` enum value of a torch dtype; TypeError for one the wire does not carry."""
    try:
        return _WIRE_DTYPE[dtype]
    except KeyError:
        names = ", ".join(str(dt) for dt in _WIRE_DTYPE)
        raise TypeError(f"dtype {dtype} cannot go on the wire; supported: {names}") from None


def dtype_from_wire(value: int, *, field: str = "dtype") -> torch.dtype:
    """The torch dtype of a `DType` enum value; FrameError naming `field` if unknown or unset."""
    dtype = _TORCH_DTYPE.get(value)  # type: ignore[call-overload]  # any int may arrive, not only a DType
    if dtype is None:
        known = ", ".join(f"{tensor_pb2.DType.Name(v)} ({v})" for v in _TORCH_DTYPE)
        what = "dtype must be set" if value == tensor_pb2.DTYPE_UNSPECIFIED else "unknown dtype"
        raise FrameError(f"{field} = {value}: {what}; expected one of {known}")
    return dtype


def _validated_nbytes(
    dtype_value: int, shape: Sequence[int], *, limits: CodecLimits, field: str
) -> tuple[torch.dtype, tuple[int, ...], int]:
    """Checks dtype and shape against the rules and limits; returns (dtype, shape, byte count)."""
    dtype = dtype_from_wire(dtype_value, field=f"{field}.dtype")
    if len(shape) > limits.max_dims:
        raise FrameLimitError(f"{field}.shape has {len(shape)} dims: at most max_dims = {limits.max_dims} allowed")
    for i, dim in enumerate(shape):
        if dim < 0:
            raise FrameError(f"{field}.shape[{i}] = {dim}: dimensions must be >= 0")
    dims = tuple(int(d) for d in shape)
    nbytes = math.prod(dims) * dtype.itemsize  # Python ints: exact for any shape
    if nbytes > limits.max_tensor_bytes:
        name = tensor_pb2.DType.Name(dtype_value)
        raise FrameLimitError(
            f"{field}.shape {list(dims)} of {name} is {nbytes} bytes: over max_tensor_bytes = {limits.max_tensor_bytes}"
        )
    if nbytes == 0:  # no elements, yet torch sizes and strides its other dims in int64: bound them too
        span = math.prod(d for d in dims if d) * dtype.itemsize
        if span > min(limits.max_tensor_bytes, _MAX_SPAN_BYTES):
            name = tensor_pb2.DType.Name(dtype_value)
            raise FrameLimitError(
                f"{field}.shape {list(dims)} of {name} holds no elements, but its nonzero dims span {span} bytes:"
                f" over max_tensor_bytes = {limits.max_tensor_bytes}"
            )
    return dtype, dims, nbytes


@dataclass(frozen=True, eq=False)
class WireTensor:
    """A tensor as the wire carries it: dtype, shape and its little-endian row-major bytes."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data: bytes | bytearray  # a bytearray once received, which the tensor `tensor()` makes of it shares

    def tensor(self) -> torch.Tensor:
        """The tensor of these bytes: over a received buffer itself (made once: frames.ReceivedStep
        keeps it), over a copy of sent bytes."""
        buf = self.data if isinstance(self.data, bytearray) else bytearray(self.data)
        return _tensor_from(buf, self.dtype, self.shape)


def wire_tensor(t: torch.Tensor) -> WireTensor:
    """`t` as its wire bytes (any layout or device; row-major from the CPU): one copy, read straight
    from the tensor's memory (a row, between steps: 47 us where `_bytes_of` and numpy took 129)."""
    dtype_to_wire(t.dtype)  # one the wire carries
    flat = t if t.is_cpu else t.to("cpu")
    if not flat.is_contiguous():
        flat = flat.contiguous()
    size = flat.nbytes
    if size > _MAX_STRING_AT:
        data = _to_bytes(_bytes_of(flat)[1])
    else:
        data = ctypes.string_at(flat.data_ptr(), size) if size else b""
    return WireTensor(t.dtype, tuple(t.shape), data)


def _tensor_from(buf: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Wraps a validated buffer (len(buf) == numel * itemsize) without copying it."""
    if not buf:  # torch.frombuffer rejects empty buffers
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(shape)


def _bytes_of(t: torch.Tensor) -> tuple[tensor_pb2.DType, torch.Tensor]:
    """(DType value, the tensor's bytes as a flat contiguous CPU uint8 tensor)."""
    wire = dtype_to_wire(t.dtype)
    if t.numel() == 0:
        return wire, torch.empty(0, dtype=torch.uint8)
    flat = t.detach().to("cpu").reshape(-1)  # [numel], row-major order
    if flat.stride(0) != 1:  # torch calls size-1 dims contiguous whatever their stride
        flat = flat.clone(memory_format=torch.contiguous_format)
    return wire, flat.view(torch.uint8)  # [numel * itemsize]


def _to_bytes(u8: torch.Tensor) -> bytes:
    """One copy of a flat uint8 tensor's bytes (numpy only copies; it never sees a dtype)."""
    return u8.numpy().tobytes()


def encode(t: torch.Tensor) -> tensor_pb2.Tensor:
    """The whole tensor in one message (any layout or device; sent row-major from the CPU)."""
    wire, u8 = _bytes_of(t)
    return tensor_pb2.Tensor(dtype=wire, shape=list(t.shape), data=_to_bytes(u8))


def decode(msg: tensor_pb2.Tensor, *, limits: CodecLimits) -> torch.Tensor:
    """The tensor of a message, validated first; the result owns its memory (a CPU tensor)."""
    dtype, shape, nbytes = _validated_nbytes(msg.dtype, msg.shape, limits=limits, field="tensor")
    data = msg.data
    if len(data) != nbytes:
        raise FrameError(
            f"tensor.data is {len(data)} bytes: shape {list(shape)} of"
            f" {tensor_pb2.DType.Name(msg.dtype)} needs {nbytes}"
        )
    return _tensor_from(bytearray(data), dtype, shape)


def chunk(t: torch.Tensor | WireTensor, max_chunk_bytes: int) -> Iterator[tensor_pb2.TensorChunk]:
    """The tensor as chunks of at most max_chunk_bytes data each (one chunk if it has no bytes); a
    tensor's bytes are copied a chunk at a time, not whole first."""
    if max_chunk_bytes <= 0:
        raise ValueError(f"max_chunk_bytes = {max_chunk_bytes}: must be > 0")
    piece: Callable[[int, int], bytes]
    if isinstance(t, WireTensor):
        dtype, shape, data = t.dtype, t.shape, memoryview(t.data)
        total = len(data)
        piece = lambda start, end: bytes(data[start:end])  # noqa: E731
    else:
        dtype, shape = t.dtype, tuple(t.shape)
        _, u8 = _bytes_of(t)
        total = u8.numel()
        piece = lambda start, end: _to_bytes(u8[start:end])  # noqa: E731
    yield tensor_pb2.TensorChunk(
        dtype=_WIRE_DTYPE[dtype], shape=shape, total_bytes=total, data=piece(0, max_chunk_bytes)
    )
    for offset in range(max_chunk_bytes, total, max_chunk_bytes):
        yield tensor_pb2.TensorChunk(offset=offset, data=piece(offset, offset + max_chunk_bytes))


def whole_chunk(t: torch.Tensor | WireTensor, into: tensor_pb2.TensorChunk, max_chunk_bytes: int) -> bool:
    """Write the tensor into `into` as its one chunk (`chunk`'s first), if its bytes fit in one;
    False, and `into` untouched, if they do not."""
    nbytes = len(t.data) if isinstance(t, WireTensor) else t.numel() * t.element_size()
    if nbytes > max_chunk_bytes:
        return False
    wire = t if isinstance(t, WireTensor) else wire_tensor(t)
    into.dtype = _WIRE_DTYPE[wire.dtype]
    into.shape.extend(wire.shape)
    into.total_bytes = nbytes
    into.data = bytes(wire.data)  # the sent bytes themselves (bytes of bytes is no copy)
    return True


class Reassembler:
    """Turns the chunks of one tensor after another back into tensors.

    Feed chunks in the order they arrive; `add` returns the tensor once its last chunk is in, and
    None before. The first chunk is validated before anything is kept (by the codec's rules, then
    by the caller's `expect`), and received bytes are held only as they arrive (a header claiming
    a large tensor reserves nothing). After a FrameError the partial tensor is dropped and the
    reassembler expects a first chunk again.
    """

    def __init__(self, *, limits: CodecLimits) -> None:
        self._limits = limits
        self._reset()

    def _reset(self) -> None:
        self._dtype: torch.dtype | None = None
        self._shape: tuple[int, ...] = ()
        self._total = 0
        self._received = 0
        self._parts: list[bytes] = []

    @property
    def in_progress(self) -> bool:
        """Whether some but not all chunks of a tensor have arrived."""
        return self._dtype is not None

    def reset(self) -> None:
        """Drops a partially received tensor."""
        self._reset()

    def add(self, msg: tensor_pb2.TensorChunk, *, expect: Expect | None = None) -> torch.Tensor | None:
        """Take the next chunk; the tensor once complete. `expect` is called at a tensor's first chunk."""
        wire = self.add_wire(msg, expect=expect)
        return None if wire is None else wire.tensor()

    def add_wire(self, msg: tensor_pb2.TensorChunk, *, expect: Expect | None = None) -> WireTensor | None:
        """`add`, the complete tensor as its validated bytes (`WireTensor.tensor` makes it a tensor)."""
        try:
            return self._add(msg, expect)
        except FrameError:
            self._reset()
            raise

    def _add(self, msg: tensor_pb2.TensorChunk, expect: Expect | None) -> WireTensor | None:
        if self._dtype is None:
            self._start(msg, expect)
        else:
            self._check_continuation(msg)
        assert self._dtype is not None
        data = msg.data
        if msg.offset != self._received:
            rule = "the first chunk" if self._received == 0 else "chunks contiguous and in order"
            raise FrameError(f"tensor_chunk.offset = {msg.offset}: expected {self._received} ({rule})")
        if self._received + len(data) > self._total:
            raise FrameError(
                f"tensor_chunk.data overruns total_bytes = {self._total}: offset {msg.offset} + {len(data)} bytes"
            )
        if not data and self._total > 0:
            raise FrameError(
                f"tensor_chunk.data is empty at offset {msg.offset}: only a zero-byte tensor may have an empty chunk"
            )
        self._parts.append(data)
        self._received += len(data)
        if self._received < self._total:
            return None
        buf = bytearray().join(self._parts)  # the one copy; the tensor owns it
        dtype, shape = self._dtype, self._shape
        self._reset()
        return WireTensor(dtype, shape, buf)

    def _start(self, msg: tensor_pb2.TensorChunk, expect: Expect | None) -> None:
        dtype, shape, nbytes = _validated_nbytes(msg.dtype, msg.shape, limits=self._limits, field="tensor_chunk")
        if msg.total_bytes != nbytes:
            raise FrameError(
                f"tensor_chunk.total_bytes = {msg.total_bytes}: shape {list(shape)} of"
                f" {tensor_pb2.DType.Name(msg.dtype)} needs {nbytes}"
            )
        if expect is not None:
            expect(dtype, shape)
        self._dtype, self._shape, self._total = dtype, shape, nbytes

    def _check_continuation(self, msg: tensor_pb2.TensorChunk) -> None:
        """A later chunk leaves dtype, shape and total_bytes unset (or repeats them exactly)."""
        assert self._dtype is not None
        if msg.dtype not in (tensor_pb2.DTYPE_UNSPECIFIED, _WIRE_DTYPE[self._dtype]):
            raise FrameError(
                f"tensor_chunk.dtype = {msg.dtype} at offset {msg.offset}: differs from the first"
                f" chunk's {_WIRE_DTYPE[self._dtype]}"
            )
        if msg.shape and tuple(msg.shape) != self._shape:
            raise FrameError(
                f"tensor_chunk.shape = {list(msg.shape)} at offset {msg.offset}: differs from the"
                f" first chunk's {list(self._shape)}"
            )
        if msg.total_bytes not in (0, self._total):
            raise FrameError(
                f"tensor_chunk.total_bytes = {msg.total_bytes} at offset {msg.offset}: differs"
                f" from the first chunk's {self._total}"
            )
