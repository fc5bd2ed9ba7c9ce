"""The paged KV cache of one stage: a fixed pool of blocks, a block table per sequence.

Owns the K and V memory of this stage's layers and which sequence holds which block. Memory is
preallocated once to a budget; a sequence grows block by block and gives everything back on
`release`. `plan_step` turns one micro-batch (which sequences, how many new tokens each) into a
`StepLayout`: the slots each new token is written to and, per sequence, the slots its attention
reads. The model only reads a layout; it never touches block tables.

Knows nothing of the network, of sampling or of which requests the sequences belong to.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from layerline.shared.errors import NoCapacity

from . import kernel_args


class KVCacheExhausted(NoCapacity):
    """The pool has too few free blocks for a sequence's new tokens."""

    def __init__(self, sequence_id: str, *, needed_blocks: int, free_blocks: int) -> None:
        super().__init__(
            f"KV cache full: sequence {sequence_id!r} needs {needed_blocks} more block(s), {free_blocks} free"
        )
        self.sequence_id = sequence_id
        self.needed_blocks = needed_blocks
        self.free_blocks = free_blocks


@dataclass(frozen=True)
class CacheShape:
    num_blocks: int  # blocks in the pool
    block_size: int  # token slots per block
    num_kv_heads: int  # key/value heads held on this device (after any tensor-parallel split)
    head_dim: int  # width of one head

    def bytes_per_block(self, *, num_layers: int, dtype: torch.dtype) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * self.block_size * self.num_kv_heads * self.head_dim * item

    @classmethod
    def for_budget(
        cls,
        budget_bytes: int,
        *,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int,
        dtype: torch.dtype,
    ) -> CacheShape:
        one = cls(1, block_size, num_kv_heads, head_dim).bytes_per_block(num_layers=num_layers, dtype=dtype)
        if budget_bytes < one:
            raise ValueError(
                f"KV memory budget of {budget_bytes} bytes is below one block ({one} bytes); raise --kv-memory"
            )
        return cls(budget_bytes // one, block_size, num_kv_heads, head_dim)


@dataclass(frozen=True)
class PrefillSpan:
    """One sequence of a step that adds more than one token (or attends over a window)."""

    rows: slice  # its new tokens' rows in the packed step
    context_slots: torch.Tensor  # [L] slots of its whole context, oldest first, new ones last
    mask: torch.Tensor | None  # [q, L] bool, True where a query may attend; None = plain causal


@dataclass(frozen=True)
class StepLayout:
    """Where one micro-batch's tokens live in the cache, computed once per step."""

    seq_lens: tuple[int, ...]  # new tokens of each sequence, in packed order
    block_size: int  # token slots per KV block
    # Every new token's absolute position, and the decode rows (single-token sequences, drafted
    # tokens), batched together: as numbers, made tensors at their first use (`positions`,
    # `decode_rows`), which a lone token's step on the compiled kernels never makes
    token_positions: tuple[int, ...]
    decode_row_ids: tuple[int, ...]
    write_slots: torch.Tensor  # [T] cache slot each new token's K and V are written to
    decode_blocks: torch.Tensor  # [D, Bmax] their block tables, padded (whole blocks are gathered)
    mask_dtype: torch.dtype  # `decode_mask`'s: the pools' dtype
    prefills: tuple[PrefillSpan, ...]  # every other sequence, one attention call each
    # The longest context of the decode batch after this step's write: no decode row attends past
    # it, so attention straight off the pools reads no further than it (paged_attention.py)
    decode_length: int
    decode_lens: torch.Tensor  # [D] the positions each decode row attends over (its own the last)
    # The positions as a range where they are one (a step of one sequence): its rotary rows are then
    # a slice of the table (StageModel.rope). None otherwise.
    positions_run: range | None
    # A step of one decoding sequence whose blocks are consecutive in the pool (as a sequence's
    # blocks are, taken from a pool nobody fragmented): its context is the slots [start, stop),
    # read as a view of the pool, without a gather and without a mask. None otherwise.
    decode_slots: slice | None = None
    # What the model derives from this layout once and reuses at every layer (paged_attention.py)
    # (a copy made by dataclasses.replace starts with an empty one: what it derived may differ)
    memo: dict[object, object] = field(default_factory=dict, compare=False, repr=False, init=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_positions)

    @property
    def positions(self) -> torch.Tensor:
        """[T] absolute position of every new token (on the CPU)."""
        return self._memo_tensor("positions", self.token_positions, torch.device("cpu"))

    @property
    def decode_rows(self) -> torch.Tensor:
        """[D] the decode rows, on the pools' device."""
        return self._memo_tensor("decode_rows", self.decode_row_ids, self.write_slots.device)

    def _memo_tensor(self, key: str, numbers: tuple[int, ...], device: torch.device) -> torch.Tensor:
        made = self.memo.get(key)
        if not isinstance(made, torch.Tensor):
            made = self.memo[key] = torch.tensor(numbers, dtype=torch.long, device=device)
        return made

    @property
    def decode_mask(self) -> torch.Tensor:
        """[D, 1, 1, Bmax * block_size] in the pools' dtype, added to the scores: 0 for the positions
        the decode rows hold, -inf for the rest of their blocks. Made at its first use in a step, once
        (given the booleans, torch's attention made it at every layer: 32 sequences, SmolLM2, two
        threads, a step 56.0 against 56.9 ms in bfloat16, 94.8 against 95.7 in float32, the same
        logits); a lone row's kernels never read it, and it cost a step 15 us to make."""
        mask = self.memo.get("decode_mask")
        if not isinstance(mask, torch.Tensor):
            held = torch.arange(self.decode_blocks.shape[1] * self.block_size) < self.decode_lens[:, None]  # [D, L]
            mask = torch.zeros(held.shape, dtype=self.mask_dtype).masked_fill_(~held, float("-inf"))[:, None, None, :]
            mask = self.memo["decode_mask"] = mask.to(self.decode_blocks.device)
        return mask

    @property
    def decode_only(self) -> bool:
        """Every row is a decode row (a sequence's one token, or drafts after it): they are all the rows, in order."""
        return len(self.prefills) == 0

    def last_rows(self) -> torch.Tensor:
        """[B] the row of each sequence's last new token (the one that is sampled)."""
        ends = torch.tensor(self.seq_lens, dtype=torch.long).cumsum(0)
        return ends - 1


class PagedKVCache:
    """K and V pools for a set of global layer ids, shared by every sequence on this stage."""

    def __init__(
        self,
        shape: CacheShape,
        *,
        layer_ids: Iterable[int],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.shape = shape
        self.dtype = dtype
        self.device = torch.device(device)
        slots = self.slots = shape.num_blocks * shape.block_size  # rows of each pool
        # Per layer: [num_blocks * block_size, num_kv_heads, head_dim], one row per token slot.
        self.k = {
            i: torch.zeros(slots, shape.num_kv_heads, shape.head_dim, dtype=dtype, device=self.device)
            for i in layer_ids
        }
        self.v = {i: torch.zeros_like(t) for i, t in self.k.items()}
        # The same pools as [1, kvh, slots, d] views: a run of a sequence's slots is one slice of
        # them, as attention takes its keys and values (rows.py).
        self.k_heads = {i: t.transpose(0, 1).unsqueeze(0) for i, t in self.k.items()}
        self.v_heads = {i: t.transpose(0, 1).unsqueeze(0) for i, t in self.v.items()}
        self._free: list[int] = list(range(shape.num_blocks))  # sorted: see `_take`
        self._tables: dict[str, list[int]] = {}
        self._lengths: dict[str, int] = {}

    @property
    def blocks_total(self) -> int:
        return self.shape.num_blocks

    @property
    def blocks_free(self) -> int:
        return len(self._free)

    def __contains__(self, sequence_id: str) -> bool:
        return sequence_id in self._tables

    def length(self, sequence_id: str) -> int:
        """Tokens of this sequence already held in the cache (0 for an unknown sequence)."""
        return self._lengths.get(sequence_id, 0)

    def sequences(self) -> list[str]:
        return list(self._tables)

    def reserve(self, sequence_id: str, new_tokens: int) -> None:
        """Make room for `new_tokens` more tokens of a sequence, all or nothing."""
        table = self._tables.get(sequence_id, [])
        need = -(-(self.length(sequence_id) + new_tokens) // self.shape.block_size) - len(table)
        if need > len(self._free):
            raise KVCacheExhausted(sequence_id, needed_blocks=need, free_blocks=len(self._free))
        table = self._tables.setdefault(sequence_id, table)
        self._lengths.setdefault(sequence_id, 0)
        if need > 0:
            table.extend(self._take(need, after=table[-1] if table else None))

    def _take(self, count: int, *, after: int | None) -> list[int]:
        """`count` free blocks, consecutive where the pool allows: those right after block `after`
        (the sequence's last), else the first run of free blocks long enough, else the lowest.
        A lone sequence whose blocks follow each other reads its KV as a view of the pool, with
        no gather (`StepLayout.decode_slots`); taking blocks from a stack instead scattered a
        sequence's blocks as soon as two sequences had come and gone."""
        free = self._free
        start = None
        if after is not None:
            at = bisect.bisect_left(free, after + 1)
            if at + count <= len(free) and free[at + count - 1] == after + count:
                start = at
        if start is None:
            start = next((i for i in range(len(free) - count + 1) if free[i + count - 1] == free[i] + count - 1), None)
        if start is None:
            taken, self._free = free[:count], free[count:]
            return taken
        taken = free[start : start + count]
        del free[start : start + count]
        return taken

    def _give_back(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            bisect.insort(self._free, block)

    def copy_prefix(self, source: str, target: str, length: int, *, room_for: int = 0) -> None:
        """Start `target` (which holds nothing) with a copy of `source`'s first `length` tokens.

        Blocks for `length + room_for` tokens are taken at once, all or nothing, so the step that
        follows needs no more. The copy is the KV of every layer held here; `target` then owns
        its blocks like any sequence (nothing is shared, nothing is counted twice on release).
        """
        assert target not in self._tables and 0 < length <= self.length(source)
        self.reserve(target, length + room_for)
        block, prefix = self.shape.block_size, range(length)
        src = torch.tensor(_slots(self._tables[source], block, prefix), dtype=torch.long, device=self.device)
        dst = torch.tensor(_slots(self._tables[target], block, prefix), dtype=torch.long, device=self.device)
        for pools in (self.k, self.v):
            for pool in pools.values():
                pool.index_copy_(0, dst, pool.index_select(0, src))
        self._lengths[target] = length

    def truncate(self, sequence_id: str, length: int) -> None:
        """Keep only a sequence's first `length` tokens (drafted ones past them were rejected);
        the blocks no longer needed go back to the pool."""
        assert 0 <= length <= self.length(sequence_id)
        table = self._tables[sequence_id]
        keep = -(-length // self.shape.block_size)
        self._give_back(table[keep:])
        del table[keep:]
        self._lengths[sequence_id] = length

    def release(self, sequence_id: str) -> bool:
        """Give a sequence's blocks back to the pool; False when it held none."""
        table = self._tables.pop(sequence_id, None)
        self._lengths.pop(sequence_id, None)
        if table is None:
            return False
        self._give_back(table)
        return True

    def plan_step(
        self,
        sequence_ids: Sequence[str],
        seq_lens: Sequence[int],
        *,
        sliding_window: int | None = None,
        drafts: Sequence[int] | None = None,
        token_rows: bool = False,
    ) -> StepLayout:
        """Lay out a step whose sequences were all `reserve`d, and advance their lengths.

        Each sequence's new tokens take positions `length .. length + n - 1`; the last `drafts[i]`
        of them are drafted tokens (speculative decoding). A sequence's tokens before its drafts are
        laid out as they would be without them, and on the CPU each drafted token is a decode row
        attending over the context up to its own position (the step writes every row's K and V
        before any row attends): each is computed as a step of that one token would compute it, to
        the bit where a lone row and a batch's rows go through the same kernels, so that a greedy
        draw is the same with and without a draft. (Each such row reads its whole context; on a
        GPU, where the decode rows' context is gathered, drafts stay in their sequence's span.)

        `token_rows` (on the CPU): every token is such a row, a prompt's too: each token's attention
        is then computed as a step of that one token computes it, whether it came in a whole prompt,
        in a chunk of one, after a copied prefix, as a replayed or a drafted token or decoded: the
        split of a sequence into steps changes no bit of it (torch's prompt kernel sums a row's
        weights in blocks that depend on how many rows came with it). The compiled kernel computes
        a sequence's consecutive rows together (kernels/paged_attention.c, `attend_rows`).
        """
        block = self.shape.block_size
        positions: list[int] = []
        write: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []  # each sequence's blocks up to its last decode row, once
        table_of: list[int] = []  # decode row -> its sequence's entry in decode_tables
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        row = 0
        on_cpu = self.device.type == "cpu"
        for seq, n, draft in zip(sequence_ids, seq_lens, drafts or [0] * len(seq_lens), strict=True):
            start = self._lengths[seq]
            table = self._tables[seq]
            end = start + n
            positions.extend(range(start, end))
            write.extend(_slots(table, block, range(start, end)))
            windowed = sliding_window is not None and end > sliding_window
            drafted = min(draft, n - 1) if draft and on_cpu and not windowed else 0
            real = end - drafted  # the tokens before the drafts: laid out as without them
            if windowed:
                decoded = real
            elif real - start == 1 or (token_rows and on_cpu):
                decoded = start  # the decode rows' first position
            else:
                decoded = real
            if decoded > start:
                prefills.append(_prefill_span(row, start, real, _slots(table, block, range(real)), sliding_window))
            if decoded < end:
                decode_tables.append(table[: -(-end // block)])
            for p in range(decoded, end):  # a lone token, then each drafted one: attending up to its own position
                decode_rows.append(row + p - start)
                table_of.append(len(decode_tables) - 1)
                decode_lens.append(p + 1)
            self._lengths[seq] = end
            row += n
        # [D, width]: each decode row's block table, padded; with its lengths and the write slots checked
        # against the pools as the compiled kernels read them, from these numbers (kernel_args.py)
        batch = kernel_args.decode_batch(decode_tables, decode_lens, block=block, slots=self.slots, table_of=table_of)
        writes = kernel_args.write_slots(write, pool_slots=self.slots)
        alone = len(decode_lens) == 1 and not prefills
        layout = StepLayout(
            seq_lens=tuple(seq_lens),
            block_size=block,
            token_positions=tuple(positions),
            decode_row_ids=tuple(decode_rows),
            write_slots=writes.slots if on_cpu else writes.slots.to(self.device),
            decode_blocks=batch.tables if on_cpu else batch.tables.to(self.device),
            mask_dtype=self.dtype,
            prefills=tuple(prefills),
            decode_length=max(decode_lens, default=0),
            decode_lens=batch.lens,
            positions_run=range(positions[0], positions[-1] + 1) if len(seq_lens) == 1 and positions else None,
            decode_slots=_consecutive(decode_tables[0], block, decode_lens[0]) if alone else None,
        )
        if on_cpu:
            layout.memo.update(decode_batch=batch, write_slots=writes)
        return layout


def _slots(table: list[int], block_size: int, positions: range) -> list[int]:
    """The cache slots of a sequence's `positions`, given its block table."""
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def _consecutive(table: list[int], block_size: int, length: int) -> slice | None:
    """The slots of a sequence's first `length` tokens as one slice, when its blocks follow each other."""
    first = table[0]
    if any(b != first + i for i, b in enumerate(table)):
        return None
    return slice(first * block_size, first * block_size + length)


def _prefill_span(row: int, start: int, end: int, slots: list[int], sliding_window: int | None) -> PrefillSpan:
    n = end - start
    mask = None
    if start > 0 or (sliding_window is not None and end > sliding_window):
        q_pos = torch.arange(start, end).unsqueeze(1)  # [q, 1]
        k_pos = torch.arange(end).unsqueeze(0)  # [1, L]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
    return PrefillSpan(
        rows=slice(row, row + n),
        context_slots=torch.tensor(slots, dtype=torch.long),
        mask=mask,
    )
