"""Products of a few float32 rows by `--quantize int4` layers through a compiled kernel
(kernels/int4.c), faster than torch's int4 kernel there and without rounding the rows.

A float32 int4 stage multiplied its rows in torch's `_weight_int4pack_mm_for_cpu`, rows rounded
to bfloat16. The kernel reads the same packed codes and bfloat16 scales and offsets where
quantize.Int4Linear keeps them for torch (torch 2.13's CPU layout: blocks of 64 outputs, input by
input; kernels/int4.c says how), so it costs no memory of its own, and multiplies the float32 rows
themselves: up to 2 at a time on AVX-512, 16 outputs a register; a lone stream's token and
decode batches of up to 3 rows (`KERNEL_ROWS`, where it was faster than torch's kernel).

`LAYERLINE_ROW_PRODUCTS` (row_kernel.py) decides as for int8's rows: under `auto` on every x86
CPU whose build has AVX-512 (the other way is torch's int4 kernel, not MKL, on Intel's too);
`kernel` and `torch` as there. The check at load multiplies random codes packed by torch's own
packer against the weight they stand for, so a torch that lays them out otherwise fails it and
keeps its own kernel.

Knows the kernel's layout and arguments; nothing of models, steps or the network.
"""

from __future__ import annotations

import functools

import torch

from layerline.shared.cpu import cpu_vendor

from . import native
from .row_kernel import TOLERANCE, RowProducts, checked_kernel, float32_row_products, plain

GROUP = 32  # inputs sharing a scale and offset: the kernel's (quantize.INT4_GROUP)
BLOCK = 16  # outputs are padded to a multiple of this (quantize.INT4_ROWS)
# Int4Linear takes the kernel for fewer rows than this, torch's for more. SmolLM2's 30 layers, two
# threads, 2 cores of an Intel Xeon without AMX (family 6 model 207), interleaved, ms, torch's
# kernel (bfloat16 rows) against this one: 1 row 5.6 / 4.6, 4.9 / 3.8 and 6.2 / 5.3, 2 rows 7.6 /
# 6.2 and 5.9 / 4.5, 4 rows 9.3 / 9.5, 8 rows 16.8 / 17.6, 16 rows 33.0 / 34.3, 31 rows 60.2 / 67.8.
KERNEL_ROWS = 4
# (out, in, bias) checked: whole blocks of 64 outputs, 16 and 48 past them, fewer than 64 in all, with
# padding past `out` (also inside the last whole block); inputs of one group and of many.
CHECKED = ((960, 576, True), (70, 64, False), (100, 96, True), (48, 32, False), (64, 1536, True), (120, 64, False))


@functools.cache
def int4_row_kernel() -> native.PagedAttentionKernel | None:
    """The compiled library where its int4 row products serve (the module's rule, checked against
    the dequantized weight's float32 product); None, logged once, otherwise."""
    vendor = cpu_vendor()
    return checked_kernel(
        "int4 row products",
        "rows_i4_vectorized",
        "built without AVX-512",
        torch_here="" if vendor else "the CPU's vendor not named",
        worst=_disagreement,
        tolerance=TOLERANCE[torch.int8],
    )


def bind_int4(
    packed: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None, out: int
) -> RowProducts | None:
    """(product, add_product) of float32 rows [R, in] by an int4 layer as quantize.Int4Linear keeps
    it for torch's CPU kernel (`packed` [padded, in / 2] uint8, `scales_and_zeros` [in / 32, padded,
    2] bfloat16, its first `out` outputs real), or None where the kernel does not serve or take it."""
    kernel = int4_row_kernel()
    return None if kernel is None else _bind(kernel, packed, scales_and_zeros, bias, out)


def _bind(
    kernel: native.PagedAttentionKernel,
    packed: torch.Tensor,
    scales_and_zeros: torch.Tensor,
    bias: torch.Tensor | None,
    out: int,
) -> RowProducts | None:
    if packed.dtype != torch.uint8 or packed.dim() != 2 or not packed.is_cpu or not packed.is_contiguous():
        return None
    padded, half = packed.shape
    fan_in = 2 * half
    if padded % BLOCK or not 0 < out <= padded or fan_in % GROUP:
        return None
    sz = scales_and_zeros
    if sz.shape != (fan_in // GROUP, padded, 2) or not plain(sz, torch.bfloat16):
        return None
    if bias is not None and not (bias.shape == (out,) and plain(bias, torch.float32)):
        return None
    call = kernel.unchecked["rows_i4"]

    def rows_i4(x: int, b: int | None, r: int | None, rows: int, threads: int, y: int) -> None:
        call(x, packed.data_ptr(), sz.data_ptr(), b, r, rows, fan_in, out, padded, threads, y)

    return float32_row_products(fan_in, out, bias, rows_i4)


def _disagreement(kernel: native.PagedAttentionKernel) -> float:
    """The kernel's largest error against the float32 product by the weight random codes stand for
    ((q - 8) * scale + offset), packed by torch's own packer, one row and three (a tile of two and
    one more), with a residual and without, as a share of the sum of |x_i w_ij| (and |residual|)."""
    worst = 0.0
    for out, fan_in, bias in CHECKED:
        generator = torch.Generator().manual_seed(out * fan_in)
        padded = -(-out // BLOCK) * BLOCK
        codes = torch.randint(0, 16, (padded, fan_in), generator=generator, dtype=torch.int32)
        sz = (torch.rand(fan_in // GROUP, padded, 2, generator=generator) - 0.5).to(torch.bfloat16)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        scale, offset = (sz.float().transpose(0, 1)[..., i].repeat_interleave(GROUP, dim=1) for i in (0, 1))
        weight = ((codes.float() - 8) * scale + offset)[:out]  # [out, in]
        b = torch.randn(out, generator=generator) if bias else None
        products = _bind(kernel, packed, sz, b, out)
        if products is None:
            raise ValueError(f"the kernel does not take int4 [{out}, {fan_in}]")
        for rows in (1, 3):
            x, residual = torch.randn(rows, fan_in, generator=generator), torch.randn(rows, out, generator=generator)
            expected = x @ weight.t() + (0 if b is None else b)
            scale_of = (x.abs() @ weight.abs().t()).clamp_min(1e-30)
            worst = max(worst, float(((products[0](x) - expected).abs() / scale_of).max()))
            added = (products[1](residual, x) - (expected + residual)).abs() / (scale_of + residual.abs())
            worst = max(worst, float(added.max()))
    return worst
