"""RMSNorm as transformers computes it: one call of the compiled kernels where they give torch's
numbers to the bit, else torch's operations.

torch's RMSNorm on CPU is a composite of small kernels (the squares, their mean, the epsilon, the
reciprocal square root, two products; in half precision a cast each way besides), and in a step
each of them reads what the last wrote after a matrix product pushed it out of the caches. The
compiled `layerline_rms_norm` (native.py, kernels/paged_attention.c) does a row in one pass over
it and one over the output, with torch's arithmetic: the squares summed in the order torch's CPU
sum takes (vectors of 8 into 4 accumulators, cascaded), divided, the epsilon added, 1 / sqrt, and
each product rounded as torch rounds it. Where a build sums or rounds otherwise (a fused
multiply-add, another order), `norm_kernel` finds it on random rows at its first use and keeps
torch's operations, logged once.

Knows the math of the norm only: tensors in, a tensor out.
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
    kernel = paged_attention.compiled_kernel()
    if kernel is None:
        return None
    try:
        exact = all(_norm_is_torchs(kernel, dtype) for dtype in native.POOL_DTYPES)
    except (OSError, ValueError) as e:
        log.warning("RMSNorm: torch's operations (%s failed its check: %s)", kernel.path, e)
        return None
    if not exact:
        log.warning("RMSNorm: torch's operations (%s does not sum or round as torch does)", kernel.path)
        return None
    return kernel


# (rows, width) checked: whole vectors and not, fewer than one group of 4 and several levels of 16,
# one row, and enough rows for the kernel's parallel loop.
CHECKED_SHAPES = ((1, 576), (5, 100), (33, 64), (3, 8), (2, 4104), (120, 576))


def _norm_is_torchs(kernel: native.PagedAttentionKernel, dtype: torch.dtype) -> bool:
    """Whether the kernel's RMSNorm equals `torch_rms_norm` on random rows of a wide range of
    magnitudes (where a fused multiply-add or another order of the sum shows in the last bit)."""
    generator = torch.Generator().manual_seed(0)
    for rows, n in CHECKED_SHAPES:
        x = torch.randn(rows, n, generator=generator) * torch.randn(rows, n, generator=generator).mul(2).exp()
        weight = torch.randn(n, generator=generator).to(dtype)
        if not torch.equal(kernel.rms_norm(x.to(dtype), weight, 1e-5), torch_rms_norm(x.to(dtype), weight, 1e-5)):
            return False
    return True
