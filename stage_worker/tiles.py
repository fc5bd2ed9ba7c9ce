"""bfloat16 products on Intel AMX tiles (kernels/tiles.c), where they serve: oneDNN's numbers, sooner.

A stage's linear layers in bfloat16 are oneDNN's packed products (layouts.PackedLinear), which on
a CPU with AMX use its tiles. Measured on SmolLM2's shapes (2 cores of an Intel Xeon with AMX, 30
layers' weights each, interleaved rounds), they read their weights at 14-21 GB/s where a sum reads
the same memory at 30; the kernel here, the same instructions in the same order with each thread
streaming whole column blocks of a weight laid out as the instruction takes it, reads them at
22-37 GB/s: 30 layers' products of one row 11.4 -> 7.9 ms, of 32 rows 13.9 -> 9.9 ms, the LM head
2.7 -> 2.1 and 3.3 -> 2.6 ms; of 128 rows 22.7 -> 21.5, 512 rows 67.5 -> 61.3.

`tile_kernel()` is the compiled library where its tiles serve: built with AMX code, granted the
tiles by Linux, and its products oneDNN's to the bit on random rows (1 to 32 rows, with and without
a bias). Past 32 rows oneDNN sums in another order, so there the numbers are this kernel's own
(each output the same sum in the same order at any row count). `layout(weight)` lays a [out, in]
weight out as the kernel reads it, once, at load; `pack` lays a weight out as the stage keeps it
packed (the tiles', else fma_blocks' where `blocks_pack`, else oneDNN's); `packed_product`
multiplies rows by a packed weight, and `bound_product` makes that product for one weight and
bias, checked once, for a plan's every step (decode_path.py, rows.py).

Knows the kernel's layout and arguments; nothing of models, steps or the network.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from . import fma_blocks, native
from .laid_out import LaidOut

log = logging.getLogger(__name__)

BLOCK_OUT, BLOCK_IN = 16, 32  # a tile block of the weight: 16 output columns by 32 inputs
# (rows, out, in) checked against oneDNN: one row, a half tile, one tile and one past, two tiles;
# SmolLM2's qkv, gate_up and down among the shapes.
CHECKED = ((1, 64, 96), (5, 96, 64), (16, 32, 576), (17, 960, 576), (32, 576, 1536), (3, 3072, 576))


def fits(weight: torch.Tensor) -> bool:
    """Whether the kernel multiplies by this [out, in] weight: bfloat16 on CPU, whole pairs of
    column blocks (out a multiple of 32), whole blocks of inputs (in a multiple of 32)."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return False
    out, fan_in = weight.shape
    return out > 0 and fan_in > 0 and out % (2 * BLOCK_OUT) == 0 and fan_in % BLOCK_IN == 0


def layout(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight (`fits`) as the kernel reads it: [out / 16, in / 32, 16, 16, 2], each
    block's 16 pairs of inputs, each pair the 16 columns' two weights (a copy)."""
    if not fits(weight):
        raise ValueError(f"no tile layout for a {list(weight.shape)} {weight.dtype} weight on {weight.device}")
    out, fan_in = weight.shape
    blocks = weight.detach().reshape(out // BLOCK_OUT, BLOCK_OUT, fan_in // BLOCK_IN, BLOCK_IN // 2, 2)
    return blocks.permute(0, 2, 3, 1, 4).contiguous()


def is_tiled(weight: torch.Tensor) -> bool:
    """Whether `weight` is in the tiles' layout (`layout`)."""
    blocks = weight.dim() == 5 and weight.shape[2:] == (BLOCK_IN // 2, BLOCK_OUT, 2) and weight.shape[0] % 2 == 0
    return blocks and weight.dtype == torch.bfloat16


def _checked(tiles: torch.Tensor) -> native.PagedAttentionKernel:
    """The kernel that multiplies by `tiles`; ValueError where none serves or they are not its layout."""
    kernel = tile_kernel()
    if kernel is None:
        raise ValueError("no AMX tile kernel serves on this CPU")
    if not is_tiled(tiles) or not tiles.is_contiguous() or tiles.device.type != "cpu":
        raise ValueError(f"tiles {list(tiles.shape)} {tiles.dtype}: not a contiguous CPU tile layout")
    return kernel


def product(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b through the kernel, for x [..., in] and W's `tiles`: [..., out], bfloat16. The
    kernel must serve (`tile_kernel()`)."""
    return _BoundTiles(tiles, bias)(x)


class _BoundTiles(LaidOut):
    """`product` by one tile layout and bias, checked once (laid_out.LaidOut)."""

    def __init__(self, tiles: torch.Tensor, bias: torch.Tensor | None) -> None:
        kernel = _checked(tiles)
        out, fan_in = tiles.shape[0] * BLOCK_OUT, tiles.shape[1] * BLOCK_IN
        fn, path = kernel.unchecked["tile_linear"], kernel.path
        no_amx = lambda rows: ValueError(f"{path} has no AMX code")  # noqa: E731
        super().__init__(
            fn, path, tiles, bias, out=out, fan_in=fan_in, dtype=torch.bfloat16, name="tiles", failure=no_amx
        )


def bound_product(weight: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """`packed_product` by one packed weight and bias, what holds for every call checked once: a
    step's 121 products of SmolLM2 skip 5-7 us of Python each (rows [32, 576] by qkv's tiles,
    2 cores of an Intel Xeon with AMX: 22.9 us through `product`, 17.6 the C call alone)."""
    if is_tiled(weight):
        return _BoundTiles(weight, bias)
    if fma_blocks.is_blocked(weight):
        return fma_blocks.BoundBlocks(weight, bias)
    if not weight.is_mkldnn:
        raise ValueError(f"a {list(weight.shape)} {weight.dtype} weight is not packed (oneDNN's, the tiles' or blocks)")
    onednn = torch.ops.mkldnn._linear_pointwise.default
    return lambda x: onednn(x, weight, bias, "none", [], "")


def packed_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b for a packed weight: the tiles' (`is_tiled`), fma_blocks' or oneDNN's."""
    return bound_product(weight, bias)(x)


def is_packed(weight: torch.Tensor) -> bool:
    """Whether `packed_product` takes this weight: the tiles' layout, fma_blocks' or oneDNN's."""
    return weight.is_mkldnn or is_tiled(weight) or fma_blocks.is_blocked(weight)


def tiled_if_served(weight: torch.Tensor) -> torch.Tensor | None:
    """The tile layout of a [out, in] weight where the kernel serves and takes it; else None."""
    return layout(weight) if fits(weight) and tile_kernel() is not None else None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight packed for `packed_product`: the tiles' layout where they serve it, else
    fma_blocks' where `blocks_pack(dtype)` and it fits, else oneDNN's (which must serve its
    dtype: layouts.can_pack)."""
    packed = tiled_if_served(weight)
    if packed is None and fma_blocks.fits(weight) and blocks_pack(weight.dtype):
        packed = fma_blocks.layout(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight, None) if packed is None else packed


def blocks_pack(dtype: torch.dtype) -> bool:
    """Whether `pack` lays weights of `dtype` out in fma_blocks' blocks on this machine (those whose
    outputs are whole blocks): its kernel serves the dtype, and the AMX tiles do not take it first."""
    if dtype not in fma_blocks.DTYPES or fma_blocks.block_kernel(dtype) is None:
        return False
    return dtype != torch.bfloat16 or tile_kernel() is None


@functools.cache
def tile_kernel() -> native.PagedAttentionKernel | None:
    """The compiled library, where its tile products serve (see the module's doc); None, logged
    once, otherwise. A bad LAYERLINE_KERNELS is a ValueError, as for the other kernels."""
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return None  # no bfloat16 instructions: nothing to compare with, and no AMX either
    try:
        kernel = native.load()
    except native.KernelUnavailable as e:
        log.info("bfloat16 AMX tiles: not used (no compiled kernel: %s)", e)
        return None
    if not kernel.unchecked["tiles_ready"]():
        log.info("bfloat16 AMX tiles: not used (none for %s on this CPU)", kernel.path)
        return None
    try:
        exact = all(_is_onednns(kernel, *shape, bias) for shape in CHECKED for bias in (False, True))
    except (OSError, ValueError, RuntimeError) as e:
        log.warning("bfloat16 AMX tiles: not used (%s failed its check: %s)", kernel.path, e)
        return None
    if not exact:
        log.warning("bfloat16 AMX tiles: not used (%s does not give oneDNN's numbers)", kernel.path)
        return None
    log.info("bfloat16 products: AMX tiles (%s)", kernel.path)
    return kernel


def _is_onednns(kernel: native.PagedAttentionKernel, rows: int, out: int, fan_in: int, bias: bool) -> bool:
    generator = torch.Generator().manual_seed(rows * out + fan_in)
    x, w = (torch.randn(*shape, generator=generator).to(torch.bfloat16) for shape in ((rows, fan_in), (out, fan_in)))
    b = torch.randn(out, generator=generator).to(torch.bfloat16) if bias else None
    theirs = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, None), b, "none", [], "")
    ours = torch.empty(rows, out, dtype=torch.bfloat16)
    tiles = layout(w)
    failed = kernel.unchecked["tile_linear"](
        x.data_ptr(), tiles.data_ptr(), None if b is None else b.data_ptr(), rows, out, fan_in, 2, ours.data_ptr()
    )
    return not failed and torch.equal(ours, theirs)
