"""Which KV a new sequence can copy instead of computing: the prefix cache of one chain.

Owns the finished sequences whose KV stays on the chain as lenders, least recently used first,
within a budget of KV blocks (a share of the chain's KV memory), and the search for the live or
cached sequence whose computed tokens hold the longest prefix of a new one's. A cached sequence
whose tokens all start a newer one's (the turn before, in a chat) gives way to it.

Knows nothing of steps, of the wire or of when KV is actually freed: it says which sequences
leave, and the scheduler frees them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator

from .steps import Sequence

# A new sequence whose first tokens equal this many or more of a live or cached sequence's on the
# same chain (a shared system prompt, the same question twice) copies their KV instead of computing it.
MIN_SHARED_PREFIX = 4


def blocks(tokens: int, block_size: int) -> int:
    """KV blocks that `tokens` positions take: the last one may be partly filled."""
    return -(-tokens // block_size)


class PrefixCache:
    def __init__(self, *, budget_blocks: int, block_size: int) -> None:
        self.budget_blocks = budget_blocks  # blocks the cache may hold at most
        self.block_size = block_size
        self._lenders: OrderedDict[str, Sequence] = OrderedDict()  # by sequence id, least recently used first
        self._used_at: dict[str, float] = {}  # sequence id -> when it last lent (or was cached)

    def __contains__(self, sequence_id: str) -> bool:
        return sequence_id in self._lenders

    def __iter__(self) -> Iterator[str]:
        return iter(self._lenders)

    def __getitem__(self, sequence_id: str) -> Sequence:
        return self._lenders[sequence_id]

    def __len__(self) -> int:
        return len(self._lenders)

    def values(self) -> list[Sequence]:
        return list(self._lenders.values())

    @property
    def tokens(self) -> int:
        return sum(s.fed for s in self._lenders.values())

    def held_blocks(self) -> int:
        return sum(blocks(s.fed, self.block_size) for s in self._lenders.values())

    def fits(self, seq: Sequence) -> bool:
        return seq.complete and seq.fed >= MIN_SHARED_PREFIX and blocks(seq.fed, self.block_size) <= self.budget_blocks

    def add(self, seq: Sequence) -> list[Sequence]:
        """Keep `seq` as a lender; returns the sequences that leave: those it covers, then the
        least recently used past the budget."""
        out = self._covered_by(seq)
        self._lenders[seq.sequence_id] = seq
        self._used_at[seq.sequence_id] = time.monotonic()
        return out + self.evicted(self.budget_blocks)

    def used(self, seq: Sequence) -> None:
        """`seq` lends to a step: last out."""
        if seq.sequence_id in self._lenders:
            self._lenders.move_to_end(seq.sequence_id)
            self._used_at[seq.sequence_id] = time.monotonic()

    def _covered_by(self, seq: Sequence) -> list[Sequence]:
        """Take out the lenders (not lent) whose computed tokens start `seq`'s: any prompt copies
        at least as much from `seq`."""
        history = seq.history
        out = [
            other
            for other in self._lenders.values()
            if not other.lent and other.fed <= seq.fed and other.history[: other.fed] == history[: other.fed]
        ]
        self._take(out)
        return out

    def evicted(self, limit: int, *, keep: Collection[str] = ()) -> list[Sequence]:
        """Take lenders out, least recently used first, until they hold at most `limit` blocks;
        lent ones and those in `keep` (sequence ids) stay."""
        over = self.held_blocks() - limit
        out: list[Sequence] = []
        for seq in list(self._lenders.values()):
            if over <= 0:
                break
            if not seq.lent and seq.sequence_id not in keep:
                out.append(seq)
                over -= blocks(seq.fed, self.block_size)
        self._take(out)
        return out

    def idle(self, seconds: float) -> list[Sequence]:
        """Take out the lenders (not lent) unused for more than `seconds`."""
        now = time.monotonic()
        out = [s for s in self._lenders.values() if not s.lent and now - self._used_at[s.sequence_id] > seconds]
        self._take(out)
        return out

    def clear(self) -> list[Sequence]:
        """Empty the cache; returns the lenders not lent (a lent one goes when its copies are done)."""
        for seq in self._lenders.values():
            seq.complete = False  # not cached again when its last copy returns
        out = [s for s in self._lenders.values() if not s.lent]
        self._lenders.clear()
        self._used_at.clear()
        return out

    def _take(self, seqs: Iterable[Sequence]) -> None:
        for seq in seqs:
            del self._lenders[seq.sequence_id]
            del self._used_at[seq.sequence_id]


def longest_prefix(seq: Sequence, lenders: Iterable[Sequence]) -> tuple[Sequence | None, int]:
    """The lender whose KV holds the longest prefix of `seq`'s history, and that length.

    Only tokens whose step came back count (`fed`), so every stage holds them; steps reach each
    stage in order, so the copy runs after them. At least the last token is left to compute,
    since the step must yield its hidden state (and, at the end, a sampled token).
    """
    history = seq.history
    best, length = None, MIN_SHARED_PREFIX - 1
    for other in lenders:
        if other is seq or other.fed <= length or other.prompt[0] != history[0]:
            continue
        n = _common_prefix(history, other.history, min(other.fed, len(history) - 1))
        if n > length:
            best, length = other, n
    return (best, length) if best is not None else (None, 0)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens `a` and `b` share, at most `limit` (slices compare in C)."""
    limit = min(limit, len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    lo, hi = 0, limit  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
