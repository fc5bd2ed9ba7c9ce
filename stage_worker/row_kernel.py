"""float32 products of a single row through the compiled kernel (kernels/rows.c), where MKL's are slow.

A lone stream's step multiplies each of SmolLM2's 121 weights by one row: the weights stream
from memory once a token, and a product can go no faster than the cores read them. torch hands
such a product to MKL, whose tuned code runs on Intel's CPUs only: on others it takes its generic
path (`mkl_blas_def_xsgemv` on an AMD EPYC Zen 3, docs/performance.md). Measured on 2 cores of an
AMD EPYC (Zen 5, AVX-512), 30 copies of each of SmolLM2's weights, one row, interleaved rounds (ms,
against the weights' bytes at the read bandwidth a sum gets): qkv 2.2-2.4 -> 1.0, o 1.5-1.9 ->
0.5-0.7, gate_up 6.2 -> 3.5-4.2, down 3.2-3.3 -> 1.6-2.2, the LM head 2.3-2.9 -> 1.2-2.0; all
121 of a token 16.1 -> 8.1 ms where reading them takes 6.8 (oneDNN's packed products: 10.5).
On an Intel Xeon MKL reads them at memory speed already (a kernel like this one was no faster
there: 23.0 against 21.5-22.5 ms, docs/performance.md), so the rule is the vendor's:

- `LAYERLINE_ROW_PRODUCTS=auto` (the default): the kernel on an x86 CPU that is not Intel's (AMD's,
  Hygon's: /proc/cpuinfo names a vendor) where it was built with AVX2 or AVX-512 (`-march=native`;
  SSE2's narrow vectors would not beat MKL's generic code), torch's products elsewhere (MKL on
  Intel's; on other architectures torch uses no MKL, and the kernel was not measured there);
- `kernel`: the kernel wherever it compiles; `torch`: torch's products everywhere.

The kernel sums in an order of its own, so its products agree with torch's to rounding, not to the
bit: `row_kernel()` checks that on random rows of every layout before it trusts a build.
`bind(weight, bias)` makes the product for one of rows.py's row weights (a float32 [in, out]
matrix, its column blocks, or a [out, in] matrix's row blocks, by their strides), or says None
where the kernel does not take it and torch's product stays.

Knows the kernel's layouts and arguments; nothing of models, steps or the network.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from layerline.shared.cpu import cpu_vendor

from . import native

log = logging.getLogger(__name__)

ENV = "LAYERLINE_ROW_PRODUCTS"  # auto | kernel | torch (see the module's doc)
VECTOR = 16  # floats a column block's width must be a multiple of (kernels/rows.c's vector)
TOLERANCE = 1e-4  # relative to the sum of |x_i w_ij|: the check's bound on the kernel's rounding


@dataclass(frozen=True)
class _Layout:
    """Where a row weight's element (i, j) lies: columns (`block`, `block_stride`, `row_stride`) or rows."""

    rows: bool  # W [out, in] row by row (rows.c's row_rows); else the columns layout
    fan_in: int
    out: int
    block: int = 0
    block_stride: int = 0
    row_stride: int = 0


def _layout(w: torch.Tensor) -> _Layout | None:
    """The kernel's layout of a row weight (rows.py's `RowWeight` tensor) by its shape and strides;
    None where the kernel does not take it."""
    if w.dtype != torch.float32 or w.device.type != "cpu" or w.layout != torch.strided or w.is_neg():
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
    if column_stride == 1 and block % VECTOR == 0:
        return _Layout(False, fan_in, out, block, block_stride, row_stride)
    # A [out, in] matrix seen as [in, out] (`.t()`), or as its row blocks [blocks, in, out / blocks]
    if row_stride == 1 and column_stride == fan_in and (blocks == 1 or block_stride == block * fan_in):
        return _Layout(True, fan_in, out)
    return None


def _plain(t: torch.Tensor) -> bool:
    """What the kernel reads of a bias or residual as it lies: float32 on the CPU, contiguous, not negated."""
    return t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() and not t.is_neg()


class _Bound:
    """The kernel's product by one row weight and bias, checked once: a call checks only its row.
    It holds the tensors and reads their addresses at each call (a tensor's storage can be swapped)."""

    def __init__(self, kernel: native.PagedAttentionKernel, layout: _Layout, w: torch.Tensor, b: torch.Tensor | None):
        self._rows, self._columns = kernel.unchecked["row_rows"], kernel.unchecked["row_columns"]
        self._layout, self._w, self._b = layout, w, b

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T + b for x [1, in]: [1, out]."""
        return self._call(x, None)

    def add_product(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x W^T + b for residual [1, out], x [1, in]: a new [1, out]."""
        if residual.shape != (1, self._layout.out) or not _plain(residual):
            return self._call(x, None).add_(residual)  # torch adds what the kernel does not read
        return self._call(x, residual)

    def _call(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        n = self._layout
        if x.shape != (1, n.fan_in) or x.dtype != torch.float32 or not x.is_cpu:
            raise ValueError(f"a row of {n.fan_in} float32 on the CPU, not {x.dtype} {list(x.shape)}")
        x = x if x.is_contiguous() and not x.is_neg() else x.resolve_neg().contiguous()
        y = torch.empty(1, n.out, dtype=torch.float32)
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
    if b is not None and not (b.shape == (layout.out,) and _plain(b)):
        return None
    kernel = row_kernel()
    if kernel is None:
        return None
    bound = _Bound(kernel, layout, w, b)
    return bound.product, bound.add_product


@functools.cache
def row_kernel() -> native.PagedAttentionKernel | None:
    """The compiled library where its row products serve (the module's rule, checked against
    torch's products); None, logged once, otherwise. A bad LAYERLINE_ROW_PRODUCTS or
    LAYERLINE_KERNELS is a ValueError: the stage does not start on it."""
    choice = os.environ.get(ENV, "auto")
    if choice not in ("auto", "kernel", "torch"):
        raise ValueError(f"{ENV}={choice!r}: must be 'auto', 'kernel' or 'torch'")
    vendor = cpu_vendor()
    if choice == "torch" or (choice == "auto" and vendor in ("GenuineIntel", "")):
        why = f", the CPU's vendor {vendor or 'not named'}" if choice == "auto" else ""
        log.info("float32 row products: torch's (%s=%s%s)", ENV, choice, why)
        return None
    try:
        kernel = native.load()
    except native.KernelUnavailable as e:
        log.info("float32 row products: torch's (no compiled kernel: %s)", e)
        return None
    if choice == "auto" and not kernel.unchecked["rows_vectorized"]():
        log.info("float32 row products: torch's (%s was built without AVX2 or AVX-512)", kernel.path)
        return None
    try:
        worst = max(_disagreement(kernel, *case) for case in CHECKED)
    except (OSError, ValueError, RuntimeError) as e:
        log.warning("float32 row products: torch's (%s failed its check: %s)", kernel.path, e)
        return None
    if not worst <= TOLERANCE:  # NaN too
        log.warning("float32 row products: torch's (%s is off by %.3g of a sum on random rows)", kernel.path, worst)
        return None
    log.info("float32 row products: the compiled kernel (%s)", kernel.path)
    return kernel


# (in, out, form, bias) checked: a plain [in, out], its column-block view (the matrix itself to the
# kernel), the LM head's contiguous blocks, a [out, in] matrix and its row blocks; widths past and
# short of the unrolled 8 rows and 16 inputs, and a last group of fewer than 4 outputs.
CHECKED = (
    (576, 960, "plain", False),
    (37, 64, "columns", True),
    (64, 96, "blocks", False),
    (1536, 576, "rows", True),
    (35, 10, "row blocks", False),
)


def _disagreement(kernel: native.PagedAttentionKernel, fan_in: int, out: int, form: str, bias: bool) -> float:
    """The kernel's largest error against torch's x W^T + b (+ a residual) on random numbers, as a
    share of the sum of |x_i w_ij| the output adds up."""
    generator = torch.Generator().manual_seed(fan_in * out)
    weight = torch.randn(out, fan_in, generator=generator)  # [out, in]
    x, residual = torch.randn(1, fan_in, generator=generator), torch.randn(1, out, generator=generator)
    b = torch.randn(out, generator=generator) if bias else None
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
    expected = x @ weight.t() + (0 if b is None else b)
    scale = (x.abs() @ weight.t().abs()).clamp_min(1e-30)
    errors = ((bound.product(x) - expected).abs() / scale).max()
    errors_added = ((bound.add_product(residual, x) - (expected + residual)).abs() / (scale + residual.abs())).max()
    return float(max(errors, errors_added))
