"""The compiled kernels (native.py) bound to one decode step: their arguments checked once a step.

A decode step runs its layers one after the other, and each layer calls the kernels of
kernels/paged_attention.c: RMSNorm twice (in a batch, each with the residual's sum before it:
`add_norm`), the rotary with the new keys and values written to the
pools (`layerline_rotate_and_store`), the attention off the pools (`layerline_paged_attention`)
and the MLP's SiLU. Their Python wrappers in native.py check every shape, dtype and index on each
call, since the C trusts what it is given, and with the modules around them that Python is a
good part of a small step. `StepKernels` makes the checks that hold for a whole step once, when
the step binds (`bind`: the rows, the cos and sin, each sequence's block table, length and write
slot against the pools' size, the widths), and a layer's call checks only what it is handed: that
each tensor has the shape, dtype and layout bound (a comparison or two; a mismatch is a
ValueError, never a call), then calls the C functions unchecked (`PagedAttentionKernel.unchecked`).

The numbers are the kernels' as the modules call them: the rotary, the writes, RMSNorm and SiLU
are torch's to the bit where they serve (`rotary_kernel`, `norm_kernel`, `silu_kernel` check that
first), the attention the decode batch's (`compiled_kernel` checks it against torch's).

Used by rows.py (a lone row: its attention, and its norms and SiLU where bound; SmolLM2's lone
step, one process, 2 cores of an Intel Xeon with AVX-512 and AMX, 12 interleaved rounds of 4
steps: float32 26.9 -> 25.4 ms, bfloat16 20.9 -> 18.8 ms against torch's rotary, writes and SDPA)
and decode_path.py (a decode batch); layer_stack.py hands what a step binds (`bound`) to the C
that runs a stage's layers in one call.

Knows the kernels' arguments (native.py declares their C types) and the pools' layout ([slots,
kv heads, head_dim]); nothing of models, weights, the engine or the network.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import kernel_args, native
from .fused import norm_kernel, silu_kernel
from .kv_cache import StepLayout
from .paged_attention import compiled_kernel, reads_pools, rotary_kernel, step_decode_batch, step_write_slots


def _check(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> None:
    if t.shape != shape or t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{what} must be a contiguous {list(shape)} {dtype} CPU tensor, not {list(t.shape)} {t.dtype}")


@dataclass(frozen=True)
class StepArguments:
    """A bound step's arguments to the C functions: the functions (`PagedAttentionKernel.unchecked`);
    the addresses of cos, sin, the write slots, the block tables and the lengths, checked against
    `pool` ([slots, kv heads, head_dim], each layer's pools); the tables' width and block size;
    the threads of its kernels other than the products; its query heads and SiLU's halves' width."""

    functions: dict[str, Any]
    addresses: tuple[int, int, int, int, int]
    pool: tuple[int, int, int]
    width: int
    block: int
    threads: int
    heads: int
    silu_width: int


class StepKernels:
    """The kernels for the `rows` rows of one decode step (one token of each of `rows` sequences):
    `attend`, and where bound with norms, `norm`, `add_norm` and `silu`."""

    def __init__(
        self,
        kernel: native.PagedAttentionKernel,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        batch: kernel_args.DecodeBatch,
        slots: kernel_args.WriteSlots,
        heads: int,
        kv_heads: int,
        head_dim: int,
        width: int,
        norms: bool,
    ) -> None:
        rows, d, dtype = batch.tables.shape[0], head_dim, cos.dtype
        if dtype not in native.POOL_DTYPES or rows < 1 or slots.slots.shape != (rows,):
            raise ValueError(f"a decode step's kernels take {native.POOL_DTYPES} and one write slot a sequence")
        for t, what in ((cos, "cos"), (sin, "sin")):
            _check(t, (rows, 1, d), dtype, what)
        if heads % kv_heads or d % 2 or slots.pool_slots != batch.slots:
            raise ValueError(f"{heads} heads over {kv_heads} kv heads of {d}, or slots checked for other pools")
        self._fn = kernel.unchecked
        self._cos, self._sin, self._batch, self._slots = cos, sin, batch, slots  # held: the C reads their memory
        self.rows, self.dtype = rows, dtype
        self._width = width  # of the SiLU's halves
        self.norms = norms  # whether `norm` and `silu` serve: their kernels give torch's numbers
        self._bf16 = dtype == torch.bfloat16
        self._heads, self._kv_heads, self._d = heads, kv_heads, d
        self._pool = (batch.slots, kv_heads, d)
        self._qkv = (rows, (heads + 2 * kv_heads) * d)
        # Every kernel gets the step's team. A lone row's attention cuts its heads among the
        # threads at any context (its keys and values are cold once a layer's products have
        # streamed: a 40-token prompt's lone steps were no slower); the other kernels share out
        # rows, so with one row they open no parallel region (kernels/paged_attention.c).
        self._threads = torch.get_num_threads()

    @property
    def bound(self) -> StepArguments:
        """What the step binds, for a caller of the C functions that runs the layers itself (layer_stack.py)."""
        b = self._batch
        addresses = (self._cos.data_ptr(), self._sin.data_ptr(), self._slots.slots.data_ptr())
        tables = (b.tables.data_ptr(), b.lens.data_ptr())
        shape = (self._pool, b.tables.shape[1], b.block, self._threads, self._heads, self._width)
        return StepArguments(self._fn, (*addresses, *tables), *shape)

    def attend(self, qkv: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        """For the rows' qkv [rows, (h + 2 kvh) d] (each row q | k | v): the rotated keys and the
        values written to the step's slots of the [slots, kvh, d] pools, and each row's attention
        over its sequence's positions: [rows, h d], in the step's dtype."""
        qkv = qkv.contiguous()
        _check(qkv, self._qkv, self.dtype, "qkv")
        _check(k_pool, self._pool, self.dtype, "the key pool")
        _check(v_pool, self._pool, self.dtype, "the value pool")
        n, h, kvh, d, bf16, threads = self.rows, self._heads, self._kv_heads, self._d, self._bf16, self._threads
        k, v = k_pool.data_ptr(), v_pool.data_ptr()
        q = torch.empty(n, h, d, dtype=self.dtype)
        cos, sin, slots = self._cos.data_ptr(), self._sin.data_ptr(), self._slots.slots.data_ptr()
        self._fn["rotate_and_store"](qkv.data_ptr(), cos, sin, slots, bf16, n, h, kvh, d, threads, q.data_ptr(), k, v)
        out = torch.empty(n, h * d, dtype=self.dtype)
        b = self._batch
        tables, lens, width, o = b.tables.data_ptr(), b.lens.data_ptr(), b.tables.shape[1], out.data_ptr()
        shape = (n, width, b.block, h, kvh, d, d**-0.5)
        failed = self._fn["paged_attention"](q.data_ptr(), bf16, k, v, bf16, tables, lens, *shape, threads, o)
        if failed:
            raise MemoryError(f"the attention kernel had no memory for {h} heads x {int(b.lens.max())} scores")
        return out

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of the rows x [rows, n] by weight [n] (where `norms`)."""
        if not self.norms:
            raise ValueError("RMSNorm was not bound: its kernel does not give torch's numbers here")
        n = weight.shape[0]
        _check(x, (self.rows, n), self.dtype, "the rows to normalize")
        _check(weight, (n,), self.dtype, "the norm's weight")
        out = torch.empty_like(x)
        rows, threads = self.rows, self._threads
        self._fn["rms_norm"](x.data_ptr(), weight.data_ptr(), self._bf16, rows, n, eps, threads, out.data_ptr())
        return out

    def add_norm(
        self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual's sum x + y of the rows x, y [rows, n] and its RMSNorm by weight [n], in
        one call (where `norms`): torch's `x + y` and `norm` of it, to the bit."""
        if not self.norms:
            raise ValueError("RMSNorm was not bound: its kernel does not give torch's numbers here")
        n = weight.shape[0]
        _check(x, (self.rows, n), self.dtype, "the residual")
        _check(y, (self.rows, n), self.dtype, "the rows added to the residual")
        _check(weight, (n,), self.dtype, "the norm's weight")
        total, out = torch.empty_like(x), torch.empty_like(x)
        ptrs = (x.data_ptr(), y.data_ptr(), weight.data_ptr())
        self._fn["add_rms_norm"](*ptrs, self._bf16, self.rows, n, eps, self._threads, total.data_ptr(), out.data_ptr())
        return total, out

    def silu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up of the rows gate_up [rows, 2 w] (where `norms`, for the w bound)."""
        width = gate_up.shape[-1] // 2
        if not self.norms or width != self._width:
            raise ValueError(f"SiLU of halves {width} wide was not bound (its kernel's numbers are not torch's)")
        _check(gate_up, (self.rows, 2 * width), self.dtype, "gate_up")
        out = torch.empty(self.rows, width, dtype=self.dtype)
        self._fn["silu_mul"](gate_up.data_ptr(), self._bf16, self.rows, width, self._threads, out.data_ptr())
        return out


def bind(
    layout: StepLayout,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    pool: torch.Tensor,
    heads: int,
    silu_width: int,
) -> StepKernels | None:
    """The kernels bound to `layout`, a step of decoding sequences only, whose layers' pools are
    like `pool`; None where they do not serve (none compiled, its rotary not torch's numbers,
    pools it does not read, another dtype) and the caller keeps torch's way. RMSNorm and the SiLU
    of halves `silu_width` wide are bound too (`norms`) where their kernels give torch's numbers."""
    kernel = compiled_kernel()
    if kernel is None or rotary_kernel() is None or not reads_pools(pool) or cos.dtype != pool.dtype:
        return None
    norms = norm_kernel() is not None and silu_kernel(silu_width) is not None
    batch = step_decode_batch(layout, slots=pool.shape[0])
    slots = step_write_slots(layout, pool_slots=pool.shape[0])
    _, kv_heads, head_dim = pool.shape
    return StepKernels(
        kernel,
        cos,
        sin,
        batch=batch,
        slots=slots,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        width=silu_width,
        norms=norms,
    )
