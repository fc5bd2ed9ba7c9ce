"""Products on float32 FMAs, the weights in blocks of 32 outputs (kernels/blocks.c): float32 and bfloat16.

On 2 cores of an Intel Xeon without AMX (family 6 model 207) torch's products left the FMAs idle:
oneDNN multiplies bfloat16 rows on the CPU's bfloat16 dot product (VDPBF16PS), which there does 32
products every 2 cycles where two float32 FMAs do 32 a cycle; MKL's and oneDNN's float32 products
of a few rows ran at half the speed of reading the weights, of 32 rows at 40% of the FMAs' rate.
The kernel keeps each weight in blocks of 32 outputs, input by input (`layout`), and multiplies up
to 12 rows' inputs, broadcast, by each input's 32 weights (bfloat16: widened in two instructions).
SmolLM2's 30 layers there (30 copies of each weight, two threads, interleaved rounds, ms):
bfloat16, oneDNN's packed weights against the kernel: 8 rows 22-28 -> 13-15, 16 rows 35-43 ->
22-30, 32 rows 53-65 -> 35-37, 128 rows 162 -> 99, 512 rows 603 -> 397, the LM head at 32 rows
12.3-16.6 -> 7.8-9.8; a lone row 7.7 where the bfloat16 row kernel on the [out, in] weight took
8.0. float32, oneDNN's packed weights / MKL's [in, out] / the kernel: 1 row 22.5-28.5 / 18.6-19.4 /
16.3-16.8, 16 rows 35.5-41.4 / 43.6-45.9 / 24.9-26.3, 32 rows 49-55 / 49.6-50.7 / 35.4-36.8, 64 rows
78.6-81.9 / 76.3-79.6 / 63.6-65.9, but 316 rows (a long prompt) 317 / 272 / 342. So where this
kernel serves, a stage keeps its weights in these blocks alone, one copy (layouts.PackedLinear),
for every row count.

`block_kernel(dtype)` decides by `LAYERLINE_ROW_PRODUCTS` (row_kernel.py) with its own `auto`: on
Intel's CPUs without AMX tiles, where it was measured; torch's elsewhere (on AMX Xeons bfloat16 has
tiles.py's kernel and float32 was not measured against it; AMD's were not measured: their VDPBF16PS
runs at another rate, and their float32 rows have row_kernel.py's kernel). `kernel` takes it
wherever it builds (AVX-512; bfloat16 not where the AMX tiles serve: tiles.blocks_pack), `torch`
nowhere. Each output is one float32 sum in
the inputs' order, the same at any row count, plus the bias (bfloat16: rounded once): it agrees with
torch's to rounding, which `block_kernel` checks at load, not to the bit; and a row's output is the
same alone and in any batch.

Knows the kernel's layout, arguments and rule; nothing of models, steps or the network.
"""

from __future__ import annotations

import functools

import torch

from layerline.shared.cpu import cpu_flags, cpu_vendor

from . import native
from .laid_out import LaidOut
from .row_kernel import TOLERANCE, checked_kernel

BLOCK = 32  # outputs a block: 32 weights of one input
DTYPES = {torch.float32: "blocks_f32_linear", torch.bfloat16: "blocks_bf16_linear"}  # the kernel's, by dtype
# (rows, out, in, bias) checked at load: a lone row, a tile of 12 and rows past it, odd widths, one
# block, SmolLM2's qkv and down shapes.
CHECKED = ((1, 960, 576, True), (13, 64, 96, False), (31, 32, 37, True), (40, 576, 1536, False), (3, 32, 7, True))


def fits(weight: torch.Tensor) -> bool:
    """Whether the kernel multiplies by this [out, in] weight: float32 or bfloat16 on CPU, whole
    blocks of outputs (out a multiple of 32)."""
    if weight.dim() != 2 or weight.dtype not in DTYPES or weight.device.type != "cpu" or weight.is_mkldnn:
        return False
    out, fan_in = weight.shape
    return out > 0 and fan_in > 0 and out % BLOCK == 0


def layout(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight (`fits`) as the kernel reads it, input by input in blocks of 32 outputs:
    float32 [out / 32, in, 2, 16], element (b, k, h, i) output 32b + 16h + i's weight of input k;
    bfloat16 [out / 32, in, 16, 2], element (b, k, i, h) the same one (a copy). Four dimensions
    tell it apart from the row weights (rows.py: two or three) and the AMX tiles' (five)."""
    if not fits(weight):
        raise ValueError(f"no block layout for a {list(weight.shape)} {weight.dtype} weight on {weight.device}")
    out, fan_in = weight.shape
    blocks = weight.detach().reshape(out // BLOCK, 2, BLOCK // 2, fan_in)  # (b, h, i, k)
    order = (0, 3, 1, 2) if weight.dtype == torch.float32 else (0, 3, 2, 1)
    return blocks.permute(*order).contiguous()


def is_blocked(weight: torch.Tensor) -> bool:
    """Whether `weight` is in the kernel's layout (`layout`), not oneDNN's, the AMX tiles' or a row weight."""
    if weight.is_mkldnn or weight.dim() != 4 or weight.dtype not in DTYPES:
        return False
    return weight.shape[2:] == ((2, BLOCK // 2) if weight.dtype == torch.float32 else (BLOCK // 2, 2))


class BoundBlocks(LaidOut):
    """x W^T + b by one weight in the kernel's layout (`layout`) and its bias, checked once
    (laid_out.LaidOut)."""

    def __init__(self, blocked: torch.Tensor, bias: torch.Tensor | None) -> None:
        dtype = blocked.dtype
        kernel = block_kernel(dtype) if dtype in DTYPES else None
        if kernel is None:
            raise ValueError(f"no {dtype} block kernel serves on this CPU")
        if not is_blocked(blocked) or not blocked.is_contiguous() or blocked.device.type != "cpu":
            raise ValueError(f"weight {list(blocked.shape)} {dtype}: not a contiguous CPU block layout")
        out, fan_in, path = blocked.shape[0] * BLOCK, blocked.shape[1], kernel.path
        no_buffer = lambda rows: MemoryError(f"{path}: no buffer for {rows} rows of {fan_in} float32")  # noqa: E731
        fn = kernel.unchecked[DTYPES[dtype]]
        super().__init__(fn, path, blocked, bias, out=out, fan_in=fan_in, dtype=dtype, name="blocks", failure=no_buffer)


@functools.cache
def block_kernel(dtype: torch.dtype) -> native.PagedAttentionKernel | None:
    """The compiled library where its block products of `dtype` (float32 or bfloat16) serve (the
    module's rule, checked against float32's products, rounded to bfloat16 for bfloat16); None,
    logged once, otherwise."""
    if dtype not in DTYPES:
        raise ValueError(f"no block kernel for {dtype}: float32 or bfloat16")
    vendor, name = cpu_vendor(), "float32" if dtype == torch.float32 else "bfloat16"
    if vendor == "GenuineIntel" and "amx_bf16" not in cpu_flags():
        torch_here = ""
    elif vendor == "GenuineIntel":
        torch_here = "measured on Intel's CPUs without AMX tiles only, and this one has them"
    else:
        torch_here = f"measured on Intel's CPUs without AMX tiles only, the CPU's vendor {vendor or 'not named'}"
    return checked_kernel(
        f"{name} products on FMAs",
        "blocks",
        "built without AVX-512",
        torch_here=torch_here,
        worst=functools.partial(_disagreement, dtype=dtype),
        tolerance=TOLERANCE[dtype],
    )


def _disagreement(kernel: native.PagedAttentionKernel, *, dtype: torch.dtype) -> float:
    """The kernel's largest error on random rows (CHECKED) against float32's x W^T + b (rounded to
    bfloat16 for bfloat16), as a share of the sum of |x_i w_ij| the output adds up."""
    worst = 0.0
    call = kernel.unchecked[DTYPES[dtype]]
    for rows, out, fan_in, bias in CHECKED:
        generator = torch.Generator().manual_seed(rows * out + fan_in)
        weight = torch.randn(out, fan_in, generator=generator).to(dtype)
        x = torch.randn(rows, fan_in, generator=generator).to(dtype)
        b = torch.randn(out, generator=generator).to(dtype) if bias else None
        y = torch.full((rows, out), float("nan"), dtype=dtype)
        blocked = layout(weight)
        bias_at = None if b is None else b.data_ptr()
        if call(x.data_ptr(), blocked.data_ptr(), bias_at, rows, out, fan_in, 2, y.data_ptr()):
            raise ValueError(f"no product of {rows} rows by [{out}, {fan_in}]")
        expected = (x.float() @ weight.float().t() + (0 if b is None else b.float())).to(dtype)
        scale = (x.float().abs() @ weight.float().t().abs()).clamp_min(1e-30)
        worst = max(worst, float(((y.float() - expected.float()).abs() / scale).max()))
    return worst
