"""A lone decoding row's rotary, KV writes and attention through the compiled kernels, checked once a step.

The row path (rows.py) runs a step of one token of one sequence layer after layer. Through
torch, each layer's rotary (a [d, d] product in float32, five elementwise kernels in half
precision), its two KV writes and its attention (torch's SDPA over a view of the pools) are
four to eight calls, each running cold after the layer's product; the decode batch's two
kernels (kernels/paged_attention.c: `layerline_rotate_and_store`, `layerline_paged_attention`)
do the same in two. Their Python wrappers in native.py check every shape and index on each call,
since the C trusts what it is given; here those checks are made once a step (`bind`: the cos and
sin, the sequence's block table and length and its write slot against the pools' size) and a
layer's call checks only that its tensors have the shapes, dtype and layout bound. Both calls run
on one thread: the kernels share out sequences and rows, and a step here has one of each.

Numbers: the rotary and the writes are torch's to the bit (`rotary_kernel` checks that before it
serves); the attention sums in float32 in another order than SDPA (`compiled_kernel` checks the
two agree before it serves), the same kernel the modules' decode batch runs. Measured on 2 cores
of an Intel Xeon (AVX-512, AMX), SmolLM2's whole lone-token step, one process, 12 interleaved
rounds of 4 steps: float32 24.1 against 25.5 ms, bfloat16 17.3 against 19.5 ms.

Knows the kernels' C signatures and the pools' layout ([slots, kv heads, head_dim]); nothing of
models, weights, the engine or the network.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from . import native
from .kv_cache import StepLayout
from .paged_attention import compiled_kernel, reads_pools, rotary_kernel

_P = ctypes.c_void_p
_I = ctypes.c_int64


@functools.cache
def _functions(path: Path) -> tuple[Any, Any]:
    """The library's rotary-and-store and attention functions, with their C signatures (kernels/paged_attention.c)."""
    library = ctypes.CDLL(str(path))  # the library native.py loaded: the same handle, its own function objects
    store = library.layerline_rotate_and_store
    store.argtypes = [_P, _P, _P, _P, ctypes.c_int, _I, _I, _I, _I, ctypes.c_int, _P, _P, _P]
    store.restype = None
    attend = library.layerline_paged_attention
    attend.argtypes = [_P, ctypes.c_int, _P, _P, ctypes.c_int, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float]
    attend.argtypes += [ctypes.c_int, _P]
    attend.restype = ctypes.c_int
    return store, attend


class RowAttention:
    """`attend(qkv, k_pool, v_pool)`: for one row's qkv [1, (h + 2 kvh) * d] (rows q | k | v), the
    rotated key and the value written to the bound slot of the [slots, kvh, d] pools, and the
    attention of the rotated query over the sequence's positions: [1, h * d], in qkv's dtype."""

    def __init__(
        self,
        kernel: native.PagedAttentionKernel,
        cos: torch.Tensor,
        sin: torch.Tensor,
        *,
        batch: native.DecodeBatch,
        slot: native.WriteSlots,
        heads: int,
        kv_heads: int,
        head_dim: int,
    ) -> None:
        d, dtype = head_dim, cos.dtype
        if dtype not in native.POOL_DTYPES or batch.tables.shape[0] != 1 or slot.slots.shape != (1,):
            raise ValueError(f"a lone row's attention takes one sequence in {native.POOL_DTYPES}")
        for t in (cos, sin):
            if t.shape != (1, 1, d) or t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"cos and sin must be contiguous [1, 1, {d}] {dtype} CPU tensors")
        if heads % kv_heads or d % 2 or slot.pool_slots != batch.slots:
            raise ValueError(f"{heads} heads over {kv_heads} kv heads of {d}, or slots checked for other pools")
        self._store, self._attend = _functions(kernel.path)
        self._cos, self._sin, self._batch, self._slot = cos, sin, batch, slot  # held: the C reads their memory
        self._pool = (batch.slots, kv_heads, d)
        self._qkv = (1, (heads + 2 * kv_heads) * d)
        self._heads, self._kv_heads, self._d, self._dtype = heads, kv_heads, d, dtype
        self._q = torch.empty(1, heads, d, dtype=dtype)  # the rotated query, rewritten by every layer

    def __call__(self, qkv: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor) -> torch.Tensor:
        qkv = qkv.contiguous()
        for t in (k_pool, v_pool):
            if t.shape != self._pool or t.dtype != self._dtype or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError(f"pools must be contiguous {list(self._pool)} {self._dtype} CPU tensors")
        if qkv.shape != self._qkv or qkv.dtype != self._dtype or qkv.device.type != "cpu" or not qkv.is_contiguous():
            raise ValueError(f"qkv must be a contiguous {list(self._qkv)} {self._dtype} CPU tensor")
        h, kvh, d = self._heads, self._kv_heads, self._d
        bf16 = self._dtype == torch.bfloat16
        k, v, q = k_pool.data_ptr(), v_pool.data_ptr(), self._q.data_ptr()
        cos, sin, slots = self._cos.data_ptr(), self._sin.data_ptr(), self._slot.slots.data_ptr()
        self._store(qkv.data_ptr(), cos, sin, slots, bf16, 1, h, kvh, d, 1, q, k, v)  # one row, one thread
        out = torch.empty(1, h * d, dtype=self._dtype)
        batch = self._batch
        tables, lens, width = batch.tables.data_ptr(), batch.lens.data_ptr(), batch.tables.shape[1]
        o = out.data_ptr()
        failed = self._attend(q, bf16, k, v, bf16, tables, lens, 1, width, batch.block, h, kvh, d, d**-0.5, 1, o)
        if failed:
            raise MemoryError(f"the attention kernel had no memory for {h} heads x {int(batch.lens[0])} scores")
        return out


def bind(
    layout: StepLayout, cos: torch.Tensor, sin: torch.Tensor, *, pool: torch.Tensor, heads: int
) -> RowAttention | None:
    """The lone row of `layout` (a step of one decoding token) bound for its layers, whose pools
    are like `pool`; None where the kernels do not serve (none compiled, or its rotary not
    torch's numbers, or pools they do not read, or another dtype): the caller keeps torch's way."""
    kernel = compiled_kernel()
    if kernel is None or rotary_kernel() is None or not reads_pools(pool) or cos.dtype != pool.dtype:
        return None
    batch = native.decode_batch(layout.decode_blocks, layout.decode_lens, block=layout.block_size, slots=pool.shape[0])
    slot = native.write_slots(layout.write_slots, pool_slots=pool.shape[0])
    _, kv_heads, head_dim = pool.shape
    return RowAttention(kernel, cos, sin, batch=batch, slot=slot, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
