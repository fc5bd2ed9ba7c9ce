"""A decode step's arguments to the compiled kernels (native.py), checked once a step: the C
trusts every index it is given, so a block table, a length or a write slot that would reach past
the pools is refused here, with a ValueError naming it, before any kernel reads it.

Python numbers are checked as Python numbers: kv_cache.plan_step hands a step's block tables,
lengths and write slots over so, and the tensors' six reductions and reads took some 35 us of a
lone token's step, its caches cold (one process, 2 cores of an Intel Xeon, family 6 model 106).
Knows nothing of layouts, models or the kernels' functions: numbers and tensors in, checked out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeBatch:
    """A decode batch's block tables and lengths, checked once a step against the pools' size."""

    tables: torch.Tensor  # [n, width] int64, contiguous: the block ids of each sequence
    lens: torch.Tensor  # [n] int64: the positions each sequence attends to (1 .. width * block)
    block: int  # slots per block
    slots: int  # slots per pool


def decode_batch(
    tables: torch.Tensor | Sequence[Sequence[int]],
    lens: torch.Tensor | Sequence[int],
    *,
    block: int,
    slots: int,
    table_of: Sequence[int] | None = None,
) -> DecodeBatch:
    """`tables` and `lens` as the kernel may read them: ValueError if any would reach past the pools.
    Python numbers: each sequence's blocks (a shorter one padded with block 0), each row's length,
    and `table_of` each row's sequence (None: a row a sequence); checked and padded once a sequence,
    not once a row (a prompt's every token is a row: kv_cache.plan_step's `token_rows`)."""
    if isinstance(tables, torch.Tensor) and isinstance(lens, torch.Tensor):
        if tables.dim() != 2 or lens.shape != (tables.shape[0],):
            raise ValueError(f"block tables {tuple(tables.shape)} and lengths {tuple(lens.shape)} do not match")
        tables, lens = tables.to("cpu", torch.int64).contiguous(), lens.to("cpu", torch.int64).contiguous()
        n, width = tables.shape
        shortest, longest = (int(lens.min()), int(lens.max())) if n else (1, 0)
        first, last = (int(tables.min()), int(tables.max())) if n and width else (0, -1)
    else:
        rows = range(len(tables)) if table_of is None else table_of
        n, width = len(rows), max(map(len, tables), default=0)
        if len(lens) != n or (n and (min(rows) < 0 or max(rows) >= len(tables))):
            raise ValueError(f"block tables ({n}, {width}) and lengths ({len(lens)},) do not match")
        shortest, longest = (min(lens), max(lens)) if n else (1, 0)
        first, last = (min(min(t) for t in tables if t), max(max(t) for t in tables if t)) if width else (0, -1)
        lens = torch.tensor(lens, dtype=torch.int64)
        padded = torch.tensor([[*t, *[0] * (width - len(t))] for t in tables], dtype=torch.int64)
        tables = padded.view(len(tables), width)
        if list(rows) != list(range(len(tables))):  # some sequence has several rows, or none
            tables = tables[torch.tensor(rows, dtype=torch.int64)]
    if shortest < 1 or longest > width * block:
        raise ValueError(f"decode lengths must lie in 1..{width * block} (block tables of {width} blocks of {block})")
    if first < 0 or last >= slots // block:
        raise ValueError(f"block ids must lie in 0..{slots // block - 1}")
    return DecodeBatch(tables, lens, block, slots)


@dataclass(frozen=True)
class WriteSlots:
    """The pool rows a step's new keys and values go to, checked once a step against the pools' size."""

    slots: torch.Tensor  # [n] int64, contiguous
    pool_slots: int  # rows per pool


def write_slots(slots: torch.Tensor | Sequence[int], *, pool_slots: int) -> WriteSlots:
    """`slots` as `rotate_and_store` may write them: ValueError if one lies outside the pools.
    Python numbers: the slots of the step's rows in order."""
    if isinstance(slots, torch.Tensor):
        slots = slots.to("cpu", torch.int64).contiguous()
        if slots.dim() != 1:
            raise ValueError(f"write slots must be one row of indices, not {tuple(slots.shape)}")
        lowest, highest = (int(slots.min()), int(slots.max())) if slots.numel() else (0, -1)
    else:
        lowest, highest = (min(slots), max(slots)) if slots else (0, -1)
        slots = torch.tensor(slots, dtype=torch.int64)
    if lowest < 0 or highest >= pool_slots:
        raise ValueError(f"write slots must lie in 0..{pool_slots - 1}")
    return WriteSlots(slots, pool_slots)
