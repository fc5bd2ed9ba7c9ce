"""Products of a single row through the compiled kernels (kernels/rows.c), where torch's are slow.

A lone stream's step multiplies each of SmolLM2's 121 weights by one row: the weights stream
from memory once a token, and a product can go no faster than the cores read them. torch hands
such a float32 product to MKL, whose tuned code runs on Intel's CPUs only: on others it takes its
generic path (`mkl_blas_def_xsgemv` on an AMD EPYC Zen 3, docs/performance.md). Measured on 2
cores of an AMD EPYC (Zen 5, AVX-512), 30 copies of each of SmolLM2's weights, one row,
interleaved rounds (ms, against the weights' bytes at the read bandwidth a sum gets): qkv 2.2-2.4
-> 1.0, o 1.5-1.9 -> 0.5-0.7, gate_up 6.2 -> 3.5-4.2, down 3.2-3.3 -> 1.6-2.2, the LM head 2.3-2.9
-> 1.2-2.0; all 121 of a token 16.1 -> 8.1 ms where reading them takes 6.8 (oneDNN's packed
products: 10.5). In bfloat16 torch's products of a row are oneDNN's packed ones; on the same
machine a row through the CPU's bfloat16 dot product (VDPBF16PS) over the plain [out, in] weight,
30 copies of each: qkv 0.89 -> 0.77, o 0.65 -> 0.37, gate_up 2.55 -> 2.51, down 1.37 -> 1.05 (the
30 layers 5.5 -> 4.7 ms, about what reading them takes). On an Intel Xeon MKL reads float32 rows at
memory speed already (a kernel like this one was no faster there: 23.0 against 21.5-22.5 ms,
docs/performance.md), so the rule is the vendor's:

- `LAYERLINE_ROW_PRODUCTS=auto` (the default): the kernels on an x86 CPU that is not Intel's (AMD's,
  Hygon's: /proc/cpuinfo names a vendor) where they were built for it (`-march=native`): float32
  with AVX2 or AVX-512 (SSE2's narrow vectors would not beat MKL's generic code), bfloat16 with
  AVX512_BF16; torch's products elsewhere (MKL on Intel's; on other architectures torch uses no
  MKL, and the kernels were not measured there);
- `kernel`: the kernels wherever they compile (bfloat16's only with its instruction);
  `torch`: torch's products everywhere.

Two exceptions serve on Intel's CPUs under `auto` too, where the other way is not MKL. bfloat16
rows, unless the CPU has AMX tiles: without them oneDNN multiplies a lone bfloat16 row on the same
bfloat16 dot product, slower (2 cores of an Intel Xeon, family 6 model 207, no AMX: SmolLM2's 30
layers 15.8 ms through oneDNN's packed weights, 9.0 through the kernel; a lone stream 38 against 60
tok/s); with them it was never measured against oneDNN's tiles. And the rows of `--quantize int8`
layers (a float32 row times int8 codes, `bind_int8`), whose other way is torch's one-row int8
kernel (`int8_row_kernel`; the same Xeon: 10.4 against 5.5 ms).

The kernels sum in an order of their own, so their products agree with torch's to rounding, not
to the bit: `row_kernel()`, `bf16_row_kernel()` and `int8_row_kernel()` check that on random rows
of every layout they take before they trust a build. `bind(weight, bias)` makes the product for one of rows.py's row
weights (a float32 [in, out] matrix, its column blocks, or a float32 or bfloat16 [out, in]
matrix's row blocks, by their strides), or says None where the kernel does not take it and
torch's product stays. A bfloat16 stage keeps the [out, in] weights for it under `--weight-layout
both` (layouts.PackedLinear), beside oneDNN's packed ones, unless fma_blocks' kernel serves (under
`auto` on the same Intel CPUs without AMX): then its blocks, one copy, take a lone row as fast.

Knows the kernel's layouts and arguments; nothing of models, steps or the network.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from layerline.shared.cpu import cpu_flags, cpu_vendor

from . import native

log = logging.getLogger(__name__)

ENV = "LAYERLINE_ROW_PRODUCTS"  # auto | kernel | torch (see the module's doc)
VECTOR = 16  # floats a column block's width must be a multiple of (kernels/rows.c's vector)
DTYPES = (torch.float32, torch.bfloat16)
# Relative to the sum of |x_i w_ij|: the check's bound on the kernel's rounding. A bfloat16 output
# is rounded to 8 bits, so the kernel's and torch's may differ by a unit of it there (2^-8 of a
# value, each rounding), hence twice that.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2.0**-7, torch.int8: 1e-4}  # int8: codes times float32 rows


@dataclass(frozen=True)
class _Layout:
    """Where a row weight's element (i, j) lies: columns (`block`, `block_stride`, `row_stride`) or rows."""

    rows: bool  # W [out, in] row by row (rows.c's row_rows); else the columns layout
    fan_in: int
    out: int
    block: int = 0
    block_stride: int = 0
    row_stride: int = 0
    dtype: torch.dtype = torch.float32  # float32 (either layout) or bfloat16 (rows only: row_rows_bf16)


def _layout(w: torch.Tensor) -> _Layout | None:
    """The kernel's layout of a row weight (rows.py's `RowWeight` tensor) by its dtype, shape and
    strides; None where the kernel does not take it."""
    if w.dtype not in DTYPES or w.device.type != "cpu" or w.layout != torch.strided or w.is_neg():
        return None
    if w.dim() not in (2, 3) or w.requires_grad:
        return None
    blocks, fan_in, block = (1, *w.shape) if w.dim() == 2 else w.shape
    block_stride = w.stride(0) if w.dim() == 3 else 0
    row_stride, column_stride = w.stride()[-2:]
    out = blocks * block
    if not (fan_in and block):
        return None
    if column_stride == 1 and blocks > 1 and block_stride == block and row_stride == out:
        block, block_stride = out, 0  # a [in, out] matrix's column blocks: the matrix itself
    if column_stride == 1 and block % VECTOR == 0 and w.dtype == torch.float32:
        return _Layout(False, fan_in, out, block, block_stride, row_stride)
    # A [out, in] matrix seen as [in, out] (`.t()`), or as its row blocks [blocks, in, out / blocks]
    if row_stride == 1 and column_stride == fan_in and (blocks == 1 or block_stride == block * fan_in):
        return _Layout(True, fan_in, out, dtype=w.dtype)
    return None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plain(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """What the kernels read of a weight, bias or residual as it lies: `dtype` on the CPU, contiguous, not negated."""
    return t.dtype == dtype and t.is_cpu and t.is_contiguous() and not t.is_neg()


class _Bound:
    """The kernel's product by one row weight and bias, checked once: a call checks only its row.
    It holds the tensors and reads their addresses at each call (a tensor's storage can be swapped)."""

    def __init__(self, kernel: native.PagedAttentionKernel, layout: _Layout, w: torch.Tensor, b: torch.Tensor | None):
        self._rows = kernel.unchecked["row_rows" if layout.dtype == torch.float32 else "row_rows_bf16"]
        self._columns = kernel.unchecked["row_columns"]
        self._layout, self._w, self._b = layout, w, b

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T + b for x [1, in]: [1, out]."""
        return self._call(x, None)

    def add_product(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x W^T + b for residual [1, out], x [1, in]: a new [1, out]."""
        if residual.shape != (1, self._layout.out) or not plain(residual, self._layout.dtype):
            return self._call(x, None).add_(residual)  # torch adds what the kernel does not read
        return self._call(x, residual)

    def _call(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        n = self._layout
        if x.shape != (1, n.fan_in) or x.dtype != n.dtype or not x.is_cpu:
            raise ValueError(f"a row of {n.fan_in} {_name(n.dtype)} on the CPU, not {_name(x.dtype)} {list(x.shape)}")
        x = x if x.is_contiguous() and not x.is_neg() else x.resolve_neg().contiguous()
        y = torch.empty(1, n.out, dtype=n.dtype)
        b = None if self._b is None else self._b.data_ptr()
        r = None if residual is None else residual.data_ptr()
        threads = torch.get_num_threads()
        if n.rows:
            self._rows(x.data_ptr(), self._w.data_ptr(), b, r, n.fan_in, n.out, threads, y.data_ptr())
        else:
            args = (n.fan_in, n.out, n.block, n.block_stride, n.row_stride, threads)
            self._columns(x.data_ptr(), self._w.data_ptr(), b, r, *args, y.data_ptr())
        return y


RowProducts = tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]


def bind(w: torch.Tensor, b: torch.Tensor | None) -> RowProducts | None:
    """(product, add_product) of a single row by this row weight and bias through the kernel
    (see rows.RowMultiply), or None where it does not serve (the module's rule) or take them."""
    layout = _layout(w)
    if layout is None:
        return None
    if b is not None and not (b.shape == (layout.out,) and plain(b, layout.dtype)):
        return None
    kernel = row_kernel() if layout.dtype == torch.float32 else bf16_row_kernel()
    if kernel is None:
        return None
    bound = _Bound(kernel, layout, w, b)
    return bound.product, bound.add_product


@functools.cache
def row_kernel() -> native.PagedAttentionKernel | None:
    """The compiled library where its float32 row products serve (the module's rule, checked
    against torch's products); None, logged once, otherwise. A bad LAYERLINE_ROW_PRODUCTS or
    LAYERLINE_KERNELS is a ValueError: the stage does not start on it."""
    return _chosen(torch.float32, "rows_vectorized", "built without AVX2 or AVX-512")


@functools.cache
def bf16_row_kernel() -> native.PagedAttentionKernel | None:
    """As `row_kernel`, for bfloat16 rows (rows.c's row_rows_bf16): only from a build with the
    CPU's bfloat16 dot product (AVX512_BF16), under `kernel` too, since without it there is none;
    under `auto` on Intel's CPUs too where they have no AMX tiles (the module's rule)."""
    return _chosen(torch.bfloat16, "rows_bf16", "built without AVX512_BF16")


@functools.cache
def int8_row_kernel() -> native.PagedAttentionKernel | None:
    """As `row_kernel`, for the rows of `--quantize int8` layers (rows.c's layerline_rows_i8: float32
    rows times int8 codes, each output's sum scaled once), under `auto` on every x86 CPU whose build
    has the kernel's vectors (AVX-512, or AVX2 with FMA), Intel's too: the other way is torch's
    `_weight_int8pack_mm`, which read a row's codes at 7-11 GB/s on 2 cores of an AMD EPYC Zen 4
    where this kernel read them at 18-40, and at 8.7 GB/s on one core of an Intel Xeon (README,
    "Quantized weights"); on 2 cores of an Intel Xeon without AMX (family 6 model 207) SmolLM2's 30
    layers took 10.4 ms a row through torch's, 5.5 through this kernel. Its AVX2 build was not
    measured."""
    return _chosen(torch.int8, "rows_i8_vectorized", "built without AVX-512 or AVX2 with FMA", any_vendor=True)


def _torchs_under_auto(dtype: torch.dtype, *, any_vendor: bool) -> str:
    """Why `auto` leaves `dtype`'s rows to torch on this CPU (the module's rule), or "" where the
    kernel may serve: no vendor named; an Intel CPU, unless `any_vendor` or, for bfloat16, it has
    no AMX tiles."""
    vendor = cpu_vendor()
    if not vendor:
        return "the CPU's vendor not named"
    if vendor != "GenuineIntel" or any_vendor:
        return ""
    if dtype == torch.bfloat16:
        return f"the CPU's vendor {vendor}, with AMX tiles" if "amx_bf16" in cpu_flags() else ""
    return f"the CPU's vendor {vendor}"


def _chosen(
    dtype: torch.dtype, built: str, unbuilt: str, *, any_vendor: bool = False
) -> native.PagedAttentionKernel | None:
    """The library if the rule allows the kernel for `dtype` (`any_vendor`: `auto` on Intel's CPUs
    too), the build has it (`built`, else `unbuilt` is logged) and it passes the check; else None."""

    def worst(kernel: native.PagedAttentionKernel) -> float:
        check = _disagreement_int8 if dtype == torch.int8 else _disagreement
        return max(check(kernel, *case, dtype=dtype) for case in CHECKED if case[2] in FORMS[dtype])

    what, torch_here = f"{_name(dtype)} row products", _torchs_under_auto(dtype, any_vendor=any_vendor)
    generic = dtype == torch.float32  # the float32 kernels compile without wide vectors too
    return checked_kernel(
        what, built, unbuilt, torch_here=torch_here, worst=worst, tolerance=TOLERANCE[dtype], generic=generic
    )


def checked_kernel(
    what: str,
    built: str,
    unbuilt: str,
    *,
    torch_here: str,
    worst: Callable[[native.PagedAttentionKernel], float],
    tolerance: float,
    generic: bool = False,
) -> native.PagedAttentionKernel | None:
    """The compiled library for `what` under LAYERLINE_ROW_PRODUCTS (`torch_here`: why `auto` leaves
    torch's products on this CPU, "" where it does not), where the build has it (`built`, else
    `unbuilt` is logged; `generic`: `kernel` takes a build without it) and its `worst` error on
    random rows is within `tolerance`; else None, logged."""
    choice = os.environ.get(ENV, "auto")
    if choice not in ("auto", "kernel", "torch"):
        raise ValueError(f"{ENV}={choice!r}: must be 'auto', 'kernel' or 'torch'")
    if choice == "torch" or (choice == "auto" and torch_here):
        why = f", {torch_here}" if choice == "auto" else ""
        log.info("%s: torch's (%s=%s%s)", what, ENV, choice, why)
        return None
    try:
        kernel = native.load()
    except native.KernelUnavailable as e:
        log.info("%s: torch's (no compiled kernel: %s)", what, e)
        return None
    if (choice == "auto" or not generic) and not kernel.unchecked[built]():
        log.info("%s: torch's (%s was %s)", what, kernel.path, unbuilt)
        return None
    try:
        error = worst(kernel)
    except (OSError, ValueError, RuntimeError) as e:
        log.warning("%s: torch's (%s failed its check: %s)", what, kernel.path, e)
        return None
    if not error <= tolerance:  # NaN too
        log.warning("%s: torch's (%s is off by %.3g of a sum on random rows)", what, kernel.path, error)
        return None
    log.info("%s: the compiled kernel (%s)", what, kernel.path)
    return kernel


# (in, out, form, bias) checked: a plain [in, out], its column-block view (the matrix itself to the
# kernel), the LM head's contiguous blocks, a [out, in] matrix and its row blocks; widths past and
# short of the unrolled 8 rows and 16 (bfloat16: 32) inputs, a last group of fewer than 4 outputs,
# and a few inputs past the last 32, where a dropped input would show above the bound.
CHECKED = (
    (576, 960, "plain", False),
    (37, 64, "columns", True),
    (64, 96, "blocks", False),
    (1536, 576, "rows", True),
    (35, 10, "row blocks", False),
    (1537, 9, "rows", True),
    (37, 576, "rows", False),
    (33, 5, "rows", True),
)
FORMS = {
    torch.float32: ("plain", "columns", "blocks", "rows", "row blocks"),
    torch.bfloat16: ("rows", "row blocks"),
    torch.int8: ("rows",),
}


def _disagreement(
    kernel: native.PagedAttentionKernel, fan_in: int, out: int, form: str, bias: bool, *, dtype: torch.dtype
) -> float:
    """The kernel's largest error against torch's x W^T + b (+ a residual) on random numbers in
    `dtype`, as a share of the sum of |x_i w_ij| the output adds up."""
    generator = torch.Generator().manual_seed(fan_in * out)
    weight = torch.randn(out, fan_in, generator=generator).to(dtype)  # [out, in]
    x, residual = torch.randn(1, fan_in, generator=generator), torch.randn(1, out, generator=generator)
    x, residual = x.to(dtype), residual.to(dtype)
    b = torch.randn(out, generator=generator).to(dtype) if bias else None
    views = {
        "plain": lambda: weight.t().contiguous(),
        "columns": lambda: weight.t().contiguous().view(fan_in, 2, out // 2).permute(1, 0, 2),
        "blocks": lambda: weight.t().contiguous().view(fan_in, 2, out // 2).permute(1, 0, 2).contiguous(),
        "rows": weight.t,
        "row blocks": lambda: weight.view(2, out // 2, fan_in).transpose(1, 2),
    }
    w = views[form]()
    layout = _layout(w)
    if layout is None or layout.rows != form.startswith("row"):
        raise ValueError(f"the {form} layout of [{out}, {fan_in}] is not the kernel's")
    bound = _Bound(kernel, layout, w, b)
    return _worst((bound.product, bound.add_product), x, residual, weight, b)


def _worst(
    products: RowProducts, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, b: torch.Tensor | None
) -> float:
    """The largest error of `products` against torch's x W^T + b, and that plus `residual`, computed
    in their dtype (bfloat16: rounded, then the residual added and rounded again), as a share of the
    sum of |x_i w_ij| the output adds up (and of |residual|)."""
    expected = x @ weight.t() + (0 if b is None else b)
    scale = (x.float().abs() @ weight.float().t().abs()).clamp_min(1e-30)
    errors = ((products[0](x).float() - expected.float()).abs() / scale).max()
    added = (products[1](residual, x).float() - (expected + residual).float()).abs()
    return float(max(errors, (added / (scale + residual.float().abs())).max()))


def _disagreement_int8(
    kernel: native.PagedAttentionKernel, fan_in: int, out: int, form: str, bias: bool, *, dtype: torch.dtype
) -> float:
    """As `_disagreement`, for int8 codes [out, in] and bfloat16 scales: against torch's float32
    product by the weight they stand for, codes * scales[:, None], of one row and of 5 at once (a
    tile of 4 rows and one more where the build takes 4)."""
    generator = torch.Generator().manual_seed(fan_in * out)
    codes = torch.randint(-128, 128, (out, fan_in), generator=generator, dtype=torch.int8)
    scales = (torch.rand(out, generator=generator) / 64 + 1e-3).to(torch.bfloat16)
    b = torch.randn(out, generator=generator) if bias else None
    products = _bind_int8(kernel, codes, scales, b)
    assert products is not None
    weight = codes.float() * scales.float()[:, None]
    rows = [(torch.randn(r, fan_in, generator=generator), torch.randn(r, out, generator=generator)) for r in (1, 5)]
    return max(_worst(products, x, residual, weight, b) for x, residual in rows)


def bind_int8(codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> RowProducts | None:
    """(product, add_product) of float32 rows [R, in] by an int8 layer (quantize.Int8Linear: codes
    [out, in], bfloat16 scales [out], float32 bias or None) through the kernel, or None where it
    does not serve (`int8_row_kernel`) or take them."""
    kernel = int8_row_kernel()
    return None if kernel is None else _bind_int8(kernel, codes, scales, bias)


def _bind_int8(
    kernel: native.PagedAttentionKernel, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> RowProducts | None:
    if codes.dtype != torch.int8 or codes.dim() != 2 or not codes.is_cpu or not codes.is_contiguous():
        return None
    out, fan_in = codes.shape
    if scales.shape != (out,) or not plain(scales, torch.bfloat16):
        return None
    if bias is not None and not (bias.shape == (out,) and plain(bias, torch.float32)):
        return None
    call = kernel.unchecked["rows_i8"]

    def rows_i8(x: int, b: int | None, r: int | None, rows: int, threads: int, y: int) -> None:
        call(x, codes.data_ptr(), scales.data_ptr(), b, r, rows, fan_in, out, threads, y)

    return float32_row_products(fan_in, out, bias, rows_i8)


RowsCall = Callable[[int, "int | None", "int | None", int, int, int], None]  # x, bias, residual, rows, threads, y


def float32_row_products(fan_in: int, out: int, bias: torch.Tensor | None, call: RowsCall) -> RowProducts:
    """(product, add_product) of float32 rows [R, in] on the CPU by a quantized layer's kernel `call`
    (its own arguments bound; the tensors by address, bias and residual None where there are none)
    and its float32 `bias`: x W^T + b, and that plus a residual [R, out] (added by torch where the
    kernel cannot read it as it lies). Rows of another width, dtype or device: a ValueError."""

    def run(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != fan_in or not x.shape[0] or x.dtype != torch.float32 or not x.is_cpu:
            raise ValueError(f"rows of {fan_in} float32 on the CPU, not {_name(x.dtype)} {list(x.shape)}")
        x = x if x.is_contiguous() and not x.is_neg() else x.resolve_neg().contiguous()
        y = torch.empty(x.shape[0], out)
        b = None if bias is None else bias.data_ptr()
        r = None if residual is None else residual.data_ptr()
        call(x.data_ptr(), b, r, x.shape[0], torch.get_num_threads(), y.data_ptr())
        return y

    def product(x: torch.Tensor) -> torch.Tensor:
        return run(x, None)

    def add_product(residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if residual.shape != (x.shape[0], out) or not plain(residual, torch.float32):
            return run(x, None).add_(residual)
        return run(x, residual)

    return product, add_product
