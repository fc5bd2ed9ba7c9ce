"""Products of a few bfloat16 rows at once (a decode batch) through a compiled kernel, where
oneDNN's are slow (kernels/rows.c's layerline_rows_bf16_batch).

On a CPU without AMX tiles oneDNN multiplies bfloat16 rows on the CPU's bfloat16 dot product
(VDPBF16PS). On 2 cores of an Intel Xeon without AMX (family 6 model 207) that instruction does 32
products every 2 cycles where two float32 FMAs do 32 a cycle, and a few rows through oneDNN took
1.5x the time of reading the weights. The kernel widens each weight to float32 in its register
and multiplies it by up to 6 rows with FMAs. SmolLM2's 30 layers there (30 copies of each weight,
two threads, interleaved rounds, ms, oneDNN's packed weights against the kernel): 2 rows 13.5 ->
8.5, 4 rows 15.4-16.9 -> 10.0-10.7, 8 rows 18.0-22.0 -> 15.2, 16 rows 34.6 -> 28.0; 32 rows 45-52
against 42-51, within the drift, so 32 rows and more stay oneDNN's (BATCH_ROWS).

`LAYERLINE_ROW_PRODUCTS` (row_kernel.py) decides as for the lone rows, with its own `auto`: the
kernel on Intel's CPUs without AMX tiles, where it was measured; oneDNN's elsewhere (AMD's run
VDPBF16PS at another rate and were not measured; AMX's tiles, tiles.py, serve there). `kernel`
takes it wherever the bfloat16 kernels build, `torch` nowhere. It multiplies the [out, in] weight
a bfloat16 stage keeps for lone rows (layouts.PackedLinear's `weight_rows`, under `--weight-layout
both` where the row kernel serves), so it costs no memory of its own. Its sums run in its own order
and are rounded to bfloat16 once, as oneDNN's are: it agrees with oneDNN to that rounding, which
`bf16_batch_kernel` checks at load, not to the bit.

Knows the kernel's arguments and the rule; nothing of models, steps or the network.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from layerline.shared.cpu import cpu_flags, cpu_vendor

from . import native
from .row_kernel import TOLERANCE, checked_kernel, plain

BATCH_ROWS = 32  # the kernel takes 2 to BATCH_ROWS - 1 rows; a lone row is row_kernel's, more oneDNN's
CHECKED = ((576, 960, 7, True), (1537, 9, 2, False), (37, 5, 13, True), (64, 33, 31, False))  # (in, out, rows, bias)

Product = Callable[[torch.Tensor], torch.Tensor]


@functools.cache
def bf16_batch_kernel() -> native.PagedAttentionKernel | None:
    """The compiled library where its bfloat16 batch products serve (the module's rule, checked
    against float32's products rounded to bfloat16); None, logged once, otherwise."""
    vendor, flags = cpu_vendor(), cpu_flags()
    if vendor == "GenuineIntel" and "amx_bf16" not in flags:
        torch_here = ""
    elif vendor == "GenuineIntel":
        torch_here = "the CPU has AMX tiles"
    else:
        torch_here = f"measured on Intel's CPUs without AMX only, the CPU's vendor {vendor or 'not named'}"
    return checked_kernel(
        "bfloat16 batch products",
        "rows_bf16",
        "built without AVX512_BF16",
        torch_here=torch_here,
        worst=_disagreement,
        tolerance=TOLERANCE[torch.bfloat16],
    )


def several_rows(weight: torch.Tensor | None, bias: torch.Tensor | None, packed: Product) -> Product:
    """x -> x W^T + b for rows x [R, in]: through the kernel by `weight` ([out, in] bfloat16, or
    None) for 2 <= R < BATCH_ROWS bfloat16 rows where it serves and takes the weight and bias;
    `packed` (the same product by the packed weight) for any other rows, or where it does not."""
    kernel = None if weight is None else bf16_batch_kernel()  # no check, nor its log line, for float32
    if kernel is None or weight is None:
        return packed
    products = _bind(kernel, weight, bias)
    if products is None:
        return packed

    def product(x: torch.Tensor) -> torch.Tensor:
        y = products(x) if x.dim() == 2 and 1 < x.shape[0] < BATCH_ROWS else None
        return packed(x) if y is None else y

    return product


def _bind(
    kernel: native.PagedAttentionKernel, weight: torch.Tensor, bias: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor | None] | None:
    """The kernel's product by `weight` and `bias` of any number of rows [R, in] (None, for the
    caller's other way, where the rows are not bfloat16 on the CPU or its buffer could not be
    had); None where it does not take the weight or bias."""
    if weight.dim() != 2 or not plain(weight, torch.bfloat16) or weight.requires_grad:
        return None
    out, fan_in = weight.shape
    if bias is not None and not (bias.shape == (out,) and plain(bias, torch.bfloat16)):
        return None
    call = kernel.unchecked["rows_bf16_batch"]

    def product(x: torch.Tensor) -> torch.Tensor | None:
        if x.dim() != 2 or x.shape[1] != fan_in or not x.shape[0] or x.dtype != torch.bfloat16 or not x.is_cpu:
            return None
        x = x if x.is_contiguous() and not x.is_neg() else x.resolve_neg().contiguous()
        y = torch.empty(x.shape[0], out, dtype=torch.bfloat16)
        b = None if bias is None else bias.data_ptr()
        done = call(x.data_ptr(), weight.data_ptr(), b, x.shape[0], fan_in, out, torch.get_num_threads(), y.data_ptr())
        return y if done == 0 else None

    return product


def _disagreement(kernel: native.PagedAttentionKernel) -> float:
    """The kernel's largest error on random bfloat16 rows against float32's x W^T + b rounded to
    bfloat16, as a share of the sum of |x_i w_ij| the output adds up: shapes with inputs past the
    last 32 and a last group of fewer than 4 outputs, a tile of 6 rows and the rows past it."""
    worst = 0.0
    for fan_in, out, rows, bias in CHECKED:
        generator = torch.Generator().manual_seed(fan_in * out + rows)
        weight = torch.randn(out, fan_in, generator=generator).to(torch.bfloat16)
        x = torch.randn(rows, fan_in, generator=generator).to(torch.bfloat16)
        b = torch.randn(out, generator=generator).to(torch.bfloat16) if bias else None
        product = _bind(kernel, weight, b)
        y = None if product is None else product(x)
        if y is None:
            raise ValueError(f"no product of {rows} rows by [{out}, {fan_in}]")
        expected = (x.float() @ weight.float().t() + (0 if b is None else b.float())).to(torch.bfloat16)
        scale = (x.float().abs() @ weight.float().t().abs()).clamp_min(1e-30)
        worst = max(worst, float(((y.float() - expected.float()).abs() / scale).max()))
    return worst
