"""RMSNorm, and the MLP's SiLU of the gate times the up projection, as transformers computes them:
one call each of the compiled kernels where they give torch's numbers to the bit, else torch's
operations.

Both are composites of small kernels in torch: RMSNorm the squares, their mean, the epsilon, the
reciprocal square root and two products (in half precision a cast each way besides); the MLP's
activation a SiLU and a product. In a step each reads what the last wrote after a matrix product
pushed it out of the caches. The compiled calls (native.py, kernels/paged_attention.c) make one
pass over their input and one over their output with torch's arithmetic: for RMSNorm the squares
summed in the order torch's CPU sum takes (vectors of 8 into 4 accumulators, cascaded), divided,
the epsilon added, 1 / sqrt, each product rounded as torch rounds it; for SiLU e^-x as torch's
vectorized kernel takes it (SLEEF's expf), the quotient and the product each rounded. Where a
build sums or rounds otherwise (a fused multiply-add where torch has none, another order), the
check at first use finds it on random rows and torch's operations stay, logged once.

Knows the math of the two only: tensors in, a tensor out.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from . import native, paged_attention

log = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, as transformers computes it: through the compiled kernel
    where it serves these tensors (`PagedAttentionKernel.takes_norm`), else `torch_rms_norm`."""
    kernel = norm_kernel()
    if kernel is not None and kernel.takes_norm(x, weight):
        return kernel.rms_norm(x, weight, eps)
    return torch_rms_norm(x, weight, eps)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension in torch's operations, as transformers computes it."""
    if x.dtype == torch.float32 == weight.dtype:  # one call, the same numbers (no casts)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # Normalized in float32, then cast, then scaled: the order transformers uses.
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


@functools.cache
def norm_kernel() -> native.PagedAttentionKernel | None:
    """The compiled kernel, for RMSNorm too, where its norm gives torch's numbers exactly on random
    rows in every dtype it takes; None, logged once, otherwise."""
    return paged_attention.exact_kernel("RMSNorm", _norm_is_torchs, "does not sum or round as torch does")


# (rows, width) checked: whole vectors and not, fewer than one group of 4 and several levels of 16,
# one row, and enough rows for the kernel's parallel loop.
CHECKED_SHAPES = ((1, 576), (5, 100), (33, 64), (3, 8), (2, 4104), (120, 576))


def _norm_is_torchs(kernel: native.PagedAttentionKernel, dtype: torch.dtype) -> bool:
    """Whether the kernel's RMSNorm equals `torch_rms_norm` on random rows of a wide range of
    magnitudes (where a fused multiply-add or another order of the sum shows in the last bit), and
    its RMSNorm after a residual's sum (`add_rms_norm`) equals torch's `x + y` and that norm."""
    generator = torch.Generator().manual_seed(0)

    def spread(rows: int, n: int) -> torch.Tensor:  # normal values scaled by e^(2 z): many magnitudes
        wide = torch.randn(rows, n, generator=generator) * torch.randn(rows, n, generator=generator).mul(2).exp()
        return wide.to(dtype)

    for rows, n in CHECKED_SHAPES:
        x, y = spread(rows, n), spread(rows, n)
        weight = torch.randn(n, generator=generator).to(dtype)
        if not torch.equal(kernel.rms_norm(x, weight, 1e-5), torch_rms_norm(x, weight, 1e-5)):
            return False
        total, normed = add_rms_norm(kernel, x, y, weight, 1e-5)
        if not (torch.equal(total, x + y) and torch.equal(normed, torch_rms_norm(x + y, weight, 1e-5))):
            return False
    return True


def add_rms_norm(
    kernel: native.PagedAttentionKernel, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x + y and its RMSNorm by weight through the kernel's `add_rms_norm`, for rows x and y [rows,
    n >= 8] and weight [n]: what `rms_norm` takes (`PagedAttentionKernel.takes_norm`), y as x.
    ValueError otherwise: the C trusts what it is given."""
    if x.dim() != 2 or not kernel.takes_norm(x, weight) or not kernel.takes_norm(y, weight) or y.shape != x.shape:
        raise ValueError(
            f"a residual's sum and norm of {x.dtype} {tuple(x.shape)} and {y.dtype} {tuple(y.shape)} by "
            f"{weight.dtype} {tuple(weight.shape)}: not taken"
        )
    total, normed = torch.empty_like(x), torch.empty_like(x)
    rows, n = x.shape
    bf16 = x.dtype == torch.bfloat16
    ptrs = (x.data_ptr(), y.data_ptr(), weight.data_ptr())
    threads = torch.get_num_threads()
    kernel.unchecked["add_rms_norm"](*ptrs, bf16, rows, n, eps, threads, total.data_ptr(), normed.data_ptr())
    return total, normed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` of gate_up [..., 2 w] (halves gate | up): through the compiled kernel
    where it serves (`PagedAttentionKernel.takes_silu`, and its check passed at this width), else
    `torch_silu_mul`."""
    kernel = silu_kernel(gate_up.shape[-1] // 2) if gate_up.dim() else None
    if kernel is not None and kernel.takes_silu(gate_up):
        return kernel.silu_mul(gate_up)
    return torch_silu_mul(gate_up)


def torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@functools.cache
def silu_kernel(width: int) -> native.PagedAttentionKernel | None:
    """The compiled kernel, for the SiLU of halves `width` wide, where it gives torch's numbers
    exactly on random rows of that width in every dtype it takes; None otherwise (logged once for a
    width it would take: torch's kernels round otherwise here)."""
    if not native.PagedAttentionKernel.takes_silu(torch.empty(1, 2 * width)):
        return None
    return paged_attention.exact_kernel(
        "SiLU", functools.partial(_silu_is_torchs, width=width), f"does not round as torch does at width {width}"
    )


def _silu_is_torchs(kernel: native.PagedAttentionKernel, dtype: torch.dtype, *, width: int) -> bool:
    """Whether the kernel's SiLU and product equal torch's on 1, 5 and 40 random rows (values up to
    about +-100 and the edges of e^x: 0 below -104, inf above 100)."""
    generator = torch.Generator().manual_seed(0)
    for rows in (1, 5, 40):
        gate_up = (torch.randn(rows, 2 * width, generator=generator) * 30).to(dtype)
        if not torch.equal(kernel.silu_mul(gate_up), torch_silu_mul(gate_up)):
            return False
    return True
