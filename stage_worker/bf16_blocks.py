"""bfloat16 products on float32 FMAs, where the CPU's bfloat16 dot product is slow (kernels/blocks.c).

On a CPU without AMX tiles oneDNN multiplies bfloat16 rows on VDPBF16PS. On 2 cores of an Intel
Xeon without AMX (family 6 model 207) that instruction does 32 products every 2 cycles where two
float32 FMAs do 32 a cycle. The kernel keeps each weight in blocks of 32 outputs, input by input
(`layout`), widens 32 weights to float32 in two instructions and multiplies them by up to 12 rows'
inputs broadcast. SmolLM2's 30 layers there (30 copies of each weight, two threads, interleaved
rounds, ms, oneDNN's packed weights against the kernel): 8 rows 22-28 -> 13-15, 16 rows 35-43 ->
22-30, 32 rows 53-65 -> 35-37, 128 rows 162 -> 99, 512 rows 603 -> 397; the LM head at 32 rows
12.3-16.6 -> 7.8-9.8. One row (7.7 ms) as fast as the bfloat16 row kernel's [out, in] weight
(8.0), a few rows faster than the kernel of a few rows on it: so where this kernel serves, the
stage keeps its weights in this layout alone, one copy (layouts.PackedLinear), for every row count.

`block_kernel()` decides by `LAYERLINE_ROW_PRODUCTS` (row_kernel.py) with its own `auto`: the kernel
on Intel's CPUs without AMX tiles, where it was measured; oneDNN's elsewhere (AMD's run VDPBF16PS at
another rate and were not measured; AMX's tiles, tiles.py, serve there). `kernel` takes it wherever
it builds (AVX-512), `torch` nowhere. Each output is one float32 sum in the inputs' order, the same
at any row count, rounded to bfloat16 once: it agrees with oneDNN to that rounding, which
`block_kernel` checks at load, not to the bit; a row's output is the same alone and in any batch.

Knows the kernel's layout, arguments and rule; nothing of models, steps or the network.
"""

from __future__ import annotations

import functools

import torch

from layerline.shared.cpu import cpu_flags, cpu_vendor

from . import native
from .row_kernel import TOLERANCE, checked_kernel

BLOCK = 32  # outputs a block: 32 bfloat16 of one input, one 64-byte load
# (rows, out, in, bias) checked at load: a lone row, a tile of 12 and rows past it, odd widths, one
# block, SmolLM2's qkv and down shapes.
CHECKED = ((1, 960, 576, True), (13, 64, 96, False), (31, 32, 37, True), (40, 576, 1536, False), (3, 32, 7, True))


def fits(weight: torch.Tensor) -> bool:
    """Whether the kernel multiplies by this [out, in] weight: bfloat16 on CPU, whole blocks of
    outputs (out a multiple of 32)."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.is_mkldnn:
        return False
    out, fan_in = weight.shape
    return out > 0 and fan_in > 0 and out % BLOCK == 0


def layout(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight (`fits`) as the kernel reads it: [out / 32, in, 32], block b's element
    (k, 2i) output 32b + i's weight of input k, (k, 2i + 1) output 32b + 16 + i's (a copy)."""
    if not fits(weight):
        raise ValueError(f"no block layout for a {list(weight.shape)} {weight.dtype} weight on {weight.device}")
    out, fan_in = weight.shape
    blocks = weight.detach().view(out // BLOCK, 2, BLOCK // 2, fan_in).permute(0, 3, 2, 1)
    return blocks.reshape(out // BLOCK, fan_in, BLOCK).contiguous()


def is_blocked(weight: torch.Tensor) -> bool:
    """Whether `weight` is in the kernel's layout (`layout`), not oneDNN's or the AMX tiles'."""
    return not weight.is_mkldnn and weight.dim() == 3 and weight.shape[2] == BLOCK and weight.dtype == torch.bfloat16


class BoundBlocks:
    """x W^T + b by one weight in the kernel's layout (`layout`) and its bias, checked once: a call
    checks only its rows. It holds the tensors and reads their addresses at each call."""

    def __init__(self, blocked: torch.Tensor, bias: torch.Tensor | None) -> None:
        kernel = block_kernel()
        if kernel is None:
            raise ValueError("no bfloat16 block kernel serves on this CPU")
        if not is_blocked(blocked) or not blocked.is_contiguous() or blocked.device.type != "cpu":
            raise ValueError(f"weight {list(blocked.shape)} {blocked.dtype}: not a contiguous CPU block layout")
        out = blocked.shape[0] * BLOCK
        if bias is not None and not (bias.shape == (out,) and bias.dtype == torch.bfloat16 and bias.is_contiguous()):
            raise ValueError(f"a bias of {out} contiguous bfloat16, not {list(bias.shape)} {bias.dtype}")
        if bias is not None and bias.device.type != "cpu":
            raise ValueError("a bias on the CPU for this weight")
        self._fn, self._path = kernel.unchecked["blocks_bf16_linear"], kernel.path
        self._blocked, self._bias, self._out, self._in = blocked, bias, out, blocked.shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # A step's rows are [rows, in] and contiguous already: as they are, a call checks four things.
        if x.dim() == 2 and x.dtype == torch.bfloat16 and x.shape[1] == self._in and x.is_cpu:
            rows = x if x.is_contiguous() and not x.is_neg() else x.resolve_neg().contiguous()
            n = rows.shape[0]
            y = torch.empty(n, self._out, dtype=torch.bfloat16)
            w, b = self._blocked.data_ptr(), None if self._bias is None else self._bias.data_ptr()
            if n and self._fn(rows.data_ptr(), w, b, n, self._out, self._in, torch.get_num_threads(), y.data_ptr()):
                raise MemoryError(f"{self._path}: no buffer for {n} rows of {self._in} float32")
            return y
        if x.dim() == 0 or x.shape[-1] != self._in or x.dtype != torch.bfloat16 or x.device.type != "cpu":
            shape = list(self._blocked.shape)
            raise ValueError(f"rows {list(x.shape)} {x.dtype} for blocks {shape}: in {self._in}, bfloat16, CPU")
        return self(x.reshape(-1, self._in)).view(*x.shape[:-1], self._out)


@functools.cache
def block_kernel() -> native.PagedAttentionKernel | None:
    """The compiled library where its bfloat16 block products serve (the module's rule, checked
    against float32's products rounded to bfloat16); None, logged once, otherwise."""
    vendor, flags = cpu_vendor(), cpu_flags()
    if vendor == "GenuineIntel" and "amx_bf16" not in flags:
        torch_here = ""
    elif vendor == "GenuineIntel":
        torch_here = "the CPU has AMX tiles"
    else:
        torch_here = f"measured on Intel's CPUs without AMX only, the CPU's vendor {vendor or 'not named'}"
    return checked_kernel(
        "bfloat16 products",
        "blocks_bf16",
        "built without AVX-512",
        torch_here=torch_here,
        worst=_disagreement,
        tolerance=TOLERANCE[torch.bfloat16],
    )


def _disagreement(kernel: native.PagedAttentionKernel) -> float:
    """The kernel's largest error on random bfloat16 rows (CHECKED) against float32's x W^T + b
    rounded to bfloat16, as a share of the sum of |x_i w_ij| the output adds up."""
    worst = 0.0
    call = kernel.unchecked["blocks_bf16_linear"]
    for rows, out, fan_in, bias in CHECKED:
        generator = torch.Generator().manual_seed(rows * out + fan_in)
        weight = torch.randn(out, fan_in, generator=generator).to(torch.bfloat16)
        x = torch.randn(rows, fan_in, generator=generator).to(torch.bfloat16)
        b = torch.randn(out, generator=generator).to(torch.bfloat16) if bias else None
        y = torch.full((rows, out), float("nan"), dtype=torch.bfloat16)
        blocked = layout(weight)
        bias_at = None if b is None else b.data_ptr()
        if call(x.data_ptr(), blocked.data_ptr(), bias_at, rows, out, fan_in, 2, y.data_ptr()):
            raise ValueError(f"no product of {rows} rows by [{out}, {fan_in}]")
        expected = (x.float() @ weight.float().t() + (0 if b is None else b.float())).to(torch.bfloat16)
        scale = (x.float().abs() @ weight.float().t().abs()).clamp_min(1e-30)
        worst = max(worst, float(((y.float() - expected.float()).abs() / scale).max()))
    return worst
