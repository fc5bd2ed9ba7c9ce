"""Attention of a batch of decoding sequences straight off the paged KV pools, on CPU; and,
before it, the batch's rotary with its new keys and values written (`rotated_and_stored`).

Float32 pools, two ways, equal up to float32 rounding: the compiled kernel (native.py,
kernels/paged_attention.c), where a C compiler made it and it agreed with torch's attention
kernel on small batches at its first use; else torch's operations (`bagged_decode_attention`,
whose notes follow this one's). Bfloat16 pools: the compiled kernel where there is one, which
widens each key and value to float32 as it reads it and keeps the scores, the probabilities and
the sums in float32 (torch's CPU kernel rounds the probabilities to bfloat16 before their product
with the values); else the caller gathers the blocks for torch's kernel (llama.py).

The compiled kernel reads each sequence's keys and values where the pools hold them, block by
block, for all its heads at once, and keeps the scores of one sequence in its thread's cache.
Measured on 2 cores of an AMD EPYC (Zen 4), SmolLM2 in float32, 32 sequences decoding 64 tokens
from 17 (30 layers, random weights, one process, six rounds in alternating order): 0.93x the
time of a whole step with torch's operations (rounds 0.84-0.99x); one layer alone, caches hot,
about the same time (120-230 us either way): the gain is in the cold pass of a real step, which
reads the pools once instead of gathering and reading again.

torch's operations: a batched decode step used to gather each sequence's whole KV blocks into
one dense tensor per layer and hand it to torch's attention kernel. At 32 sequences that moves the whole batch's keys
and values three times a layer (read, write, read again), and torch's CPU flash kernel spends
most of its time on the small, strided pieces it is given. Here:

- the keys are gathered once, head-major, one 64-wide row per (sequence, kv head, position), so
  the scores are one batched product with no grouped-query copy;
- the softmax runs under the step's additive mask;
- the values are never gathered: `embedding_bag` sums each query head's value rows straight out
  of the pool, weighted by its probabilities (a padded position weighs exactly 0);
- every sequence is read up to the batch's longest context, not to the end of its last block:
  32 sequences of SmolLM2's heads growing from 18 to 81 tokens, 30 layers, interleaved on 2
  cores of an AMD EPYC (Zen 4): 0.86x and 0.90x the time of reading whole blocks of 16.

The indices depend only on the step's block tables and the model's head counts: they are made
once a step (`bag_indices`) and reused by every layer.

Measured on 2 cores of an AMD EPYC (Zen 3, AVX2), SmolLM2 in float32: one layer's attention for
32 sequences of 96 tokens 1.0-1.7 ms against 1.6-2.6 (the gather and torch's kernel); a whole
32-sequence decode step, interleaved in one process, 0.92-0.94x the time (172 against 184 ms),
8 sequences 0.98x; 32 streams on a 2-stage cluster 1.09x the tokens per second (paired rounds,
155 against 142 tok/s). Without the compiled kernel, half precision keeps torch's kernel.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import kernel_args, native
from .kv_cache import StepLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BagIndices:
    """Where a decode batch's keys and values are, as rows of a pool viewed as [slots * kvh, d]."""

    key_rows: torch.Tensor  # [D * kvh * L]: (sequence, kv head, position) -> pool row
    value_rows: torch.Tensor  # [D * h * L]: (sequence, query head, position) -> pool row of its kv head
    offsets: torch.Tensor  # [D * h]: where each (sequence, query head)'s bag starts in value_rows
    mask: torch.Tensor  # [D, 1, 1, L]: the layout's additive mask up to L, the batch's longest context


def bag_indices(layout: StepLayout, *, heads: int, kv_heads: int) -> BagIndices:
    """The pool rows of `layout`'s decode batch for a model of `heads` query and `kv_heads` key/value
    heads per rank, made on the first layer's call and kept on the layout for the others.

    Each sequence is read up to the batch's longest context (`decode_length`), not to the end of
    its last block: the positions past it are masked for every row, so they would only cost."""
    key = ("bags", heads, kv_heads)
    found = layout.memo.get(key)
    if not isinstance(found, BagIndices):
        blocks, size, length = layout.decode_blocks, layout.block_size, layout.decode_length
        n, width = blocks.shape
        slots = (blocks[:, :, None] * size + torch.arange(size, device=blocks.device)).view(n, 1, width * size)
        slots = slots[:, :, :length]
        kv_of_head = torch.arange(heads, device=blocks.device) // (heads // kv_heads)
        found = BagIndices(
            key_rows=(slots * kv_heads + torch.arange(kv_heads, device=blocks.device)[:, None]).flatten(),
            value_rows=(slots * kv_heads + kv_of_head[:, None]).flatten(),
            offsets=torch.arange(n * heads, device=blocks.device) * length,
            mask=layout.decode_mask[..., :length].contiguous(),
        )
        layout.memo[key] = found
    return found


def reads_pools(pool: torch.Tensor) -> bool:
    """Whether `paged_decode_attention` takes pools like `pool`: float32 ones on the CPU, and
    bfloat16 ones on the CPU where the compiled kernel is."""
    if pool.device.type != "cpu":
        return False
    return pool.dtype == torch.float32 or (pool.dtype == torch.bfloat16 and compiled_kernel() is not None)


def attends_off_pools(pool: torch.Tensor) -> bool:
    """Whether the compiled kernel attends off pools like `pool` (on the CPU, float32 or bfloat16)."""
    return reads_pools(pool) and compiled_kernel() is not None


def paged_decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, *, layout: StepLayout
) -> torch.Tensor:
    """Attention of one new token per sequence of `layout`'s decode batch: q [D, h, d] over the
    [slots, kvh, d] pools (as `reads_pools` takes them), each sequence over the positions it
    holds. Returns [D, h * d]. The compiled kernel's where there is one, else torch's operations'."""
    kernel = compiled_kernel()
    if kernel is None:
        if k_pool.dtype != torch.float32:
            raise ValueError(f"{k_pool.dtype} pools need the compiled kernel, and there is none")
        return bagged_decode_attention(q, k_pool, v_pool, layout=layout)
    return kernel(q, k_pool, v_pool, step_decode_batch(layout, slots=k_pool.shape[0]))


def step_decode_batch(layout: StepLayout, *, slots: int) -> kernel_args.DecodeBatch:
    """`layout`'s block tables and lengths as the kernel reads them, checked against pools of
    `slots` rows once a step (kept in `layout.memo` for every layer; kv_cache.plan_step puts them
    there on the CPU, checked against its pools)."""
    batch = layout.memo.get("decode_batch")
    if not isinstance(batch, kernel_args.DecodeBatch) or batch.slots != slots:
        batch = kernel_args.decode_batch(layout.decode_blocks, layout.decode_lens, block=layout.block_size, slots=slots)
        layout.memo["decode_batch"] = batch
    return batch


def step_write_slots(layout: StepLayout, *, pool_slots: int) -> kernel_args.WriteSlots:
    """`layout`'s write slots as the kernel writes them, checked against pools of `pool_slots`
    rows once a step (kept in `layout.memo` for every layer)."""
    slots = layout.memo.get("write_slots")
    if not isinstance(slots, kernel_args.WriteSlots) or slots.pool_slots != pool_slots:
        slots = kernel_args.write_slots(layout.write_slots, pool_slots=pool_slots)
        layout.memo["write_slots"] = slots
    return slots


@functools.cache
def compiled_kernel() -> native.PagedAttentionKernel | None:
    """The compiled kernel, loaded (and compiled if need be) at the first call and then checked
    against torch's operations on a small batch; None, logged once, where there is none or it
    disagrees. A stage calls this as it loads, so that its first step does not compile."""
    try:
        kernel = native.load()  # a bad LAYERLINE_KERNELS is a ValueError: the stage does not start
    except native.KernelUnavailable as e:
        log.info("decode attention: torch's operations (no compiled kernel: %s)", e)
        return None
    try:
        difference = max(
            _disagreement(kernel, heads=6, kv_heads=2, d=16),
            _disagreement(kernel, heads=9, kv_heads=3, d=64),
            _disagreement(kernel, heads=9, kv_heads=3, d=64, dtype=torch.bfloat16),
        )
    except (OSError, ValueError, MemoryError) as e:
        log.warning("decode attention: torch's operations (%s failed its check: %s)", kernel.path, e)
        return None
    if not difference <= 1e-4:  # NaN too
        log.warning("decode attention: torch's operations (%s is off by %.3g on a test batch)", kernel.path, difference)
        return None
    log.info("decode attention: the compiled kernel %s", kernel.path)
    return kernel


def rotated_and_stored(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    *,
    heads: int,
    layout: StepLayout,
) -> torch.Tensor | None:
    """A decode batch's rotary and its KV written in one call of the compiled kernel: qkv [D, heads
    + 2 kvh, d] (rows q | k | v), cos and the signed sin [D, 1, d]; the rotated keys and the values
    go to `layout.write_slots`; returns the rotated queries [D, heads, d], the same numbers as
    llama.py's operations give. None where the kernel does not serve (none, or its rotary is not
    torch's numbers, or pools it does not read): the caller then runs torch's operations.

    Those operations are six small kernels and two copies a layer, each reading what the last one
    wrote after the layer's product pushed it out of the caches: in a 32-row float32 step (SmolLM2,
    one process, Zen 4, two threads) 4.3-5.6 ms of rotary and 1.3 ms of writes a step, against
    1.8 ms for this call (61 us a layer; 11 us with everything hot). Whole steps, interleaved in
    one process: 0.96x the time at 32 rows in float32, 0.97x in bfloat16, 0.98x at 8 rows."""
    kernel = rotary_kernel()
    if kernel is None or not reads_pools(k_pool) or qkv.dtype != k_pool.dtype:
        return None
    slots = step_write_slots(layout, pool_slots=k_pool.shape[0])
    return kernel.rotate_and_store(qkv, cos, sin, k_pool, v_pool, slots, heads=heads)


@functools.cache
def rotary_kernel() -> native.PagedAttentionKernel | None:
    """The compiled kernel, for rotary too, where its rotary gives torch's numbers exactly on a
    small random batch in every pool dtype (a compiler that fused a multiply-add would not);
    None, logged once, otherwise."""
    return exact_kernel("rotary", _rotary_is_torchs, "does not round as torch does")


def exact_kernel(
    part: str, is_torchs: Callable[[native.PagedAttentionKernel, torch.dtype], bool], otherwise: str
) -> native.PagedAttentionKernel | None:
    """The compiled kernel, for `part` of a step, where `is_torchs(kernel, dtype)` holds in every
    pool dtype: its numbers are torch's to the bit. None otherwise, logged (`part: torch's
    operations (the library, why)`): the caller keeps torch's operations for that part."""
    kernel = compiled_kernel()
    if kernel is None:
        return None
    try:
        exact = all(is_torchs(kernel, dtype) for dtype in native.POOL_DTYPES)
    except (OSError, ValueError) as e:
        log.warning("%s: torch's operations (%s failed its check: %s)", part, kernel.path, e)
        return None
    if not exact:
        log.warning("%s: torch's operations (%s %s)", part, kernel.path, otherwise)
        return None
    return kernel


def _rotary_is_torchs(kernel: native.PagedAttentionKernel, dtype: torch.dtype) -> bool:
    """Whether the kernel's rotary and stores equal torch's on 5 random rows of 6 heads and 2 kv heads."""
    generator = torch.Generator().manual_seed(0)
    n, heads, kvh, d = 5, 6, 2, 16
    qkv = (torch.randn(n, heads + 2 * kvh, d, generator=generator) * 100).to(dtype)
    cos, sin = (torch.randn(n, 1, d, generator=generator).to(dtype) for _ in range(2))
    slots = torch.randperm(12, generator=generator)[:n]
    k_pool, v_pool = torch.zeros(12, kvh, d, dtype=dtype), torch.zeros(12, kvh, d, dtype=dtype)
    stores = kernel_args.write_slots(slots, pool_slots=12)
    q = kernel.rotate_and_store(qkv, cos, sin, k_pool, v_pool, stores, heads=heads)
    qk = qkv[:, : heads + kvh]
    rotated = qk * cos + qk.roll(d // 2, -1) * sin  # rolling by half a head swaps its halves
    return (
        torch.equal(q, rotated[:, :heads])
        and torch.equal(k_pool[slots], rotated[:, heads:])
        and torch.equal(v_pool[slots], qkv[:, heads + kvh :])
        and int(k_pool.count_nonzero()) == int(rotated[:, heads:].count_nonzero())  # nothing written elsewhere
    )


def _disagreement(
    kernel: native.PagedAttentionKernel, *, heads: int, kv_heads: int, d: int, dtype: torch.dtype = torch.float32
) -> float:
    """The largest difference between the kernel and torch's attention kernel on a small random
    batch: 4 sequences of 1-37 positions in blocks of 4 taken out of order, the pools in `dtype`
    (torch's in float32 on the same values)."""
    generator = torch.Generator().manual_seed(0)
    block, width = 4, 10
    k_held, v_held = (torch.randn(40 * block, kv_heads, d, generator=generator).to(dtype) for _ in range(2))
    tables = torch.randperm(40, generator=generator)[: 4 * width].view(4, width)
    lens = torch.tensor([37, 1, 16, 9])
    q = torch.randn(4, heads, d, generator=generator)
    ours = kernel(q, k_held, v_held, kernel_args.decode_batch(tables, lens, block=block, slots=40 * block))
    k_pool, v_pool = k_held.float(), v_held.float()
    held = torch.arange(width * block) < lens[:, None]
    mask = torch.zeros(held.shape).masked_fill_(~held, float("-inf"))[:, None, None, :]
    keys = k_pool.view(40, block * kv_heads * d)[tables.flatten()].view(4, width * block, kv_heads, d).transpose(1, 2)
    values = v_pool.view(40, block * kv_heads * d)[tables.flatten()].view(4, width * block, kv_heads, d).transpose(1, 2)
    grouped = q.view(4, kv_heads, heads // kv_heads, d)
    reference = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask).reshape(4, heads * d)
    return float((ours - reference).abs().max())


def bagged_decode_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, *, layout: StepLayout
) -> torch.Tensor:
    """`paged_decode_attention` in torch's operations, under `layout.decode_mask` (up to the
    batch's longest context)."""
    n, h, d = q.shape
    kvh = k_pool.shape[1]
    bags = bag_indices(layout, heads=h, kv_heads=kvh)
    length = bags.mask.shape[-1]
    keys = k_pool.view(-1, d).index_select(0, bags.key_rows).view(n * kvh, length, d)
    scores = torch.bmm(q.reshape(n * kvh, h // kvh, d), keys.transpose(1, 2))  # [D * kvh, h / kvh, L]
    scores = scores.view(n, kvh, h // kvh, length).mul_(d**-0.5).add_(bags.mask)
    probs = torch.softmax(scores, dim=-1)  # [D, kvh, h / kvh, L]: query head order
    out = F.embedding_bag(
        bags.value_rows, v_pool.view(-1, d), bags.offsets, mode="sum", per_sample_weights=probs.flatten()
    )
    return out.view(n, h * d)
