"""Drafting tokens without a draft model: prompt lookup over a sequence's own history.

Owns, for one sequence, an index of the n-grams (n from `MIN_NGRAM` to `MAX_NGRAM`) of its tokens
so far (prompt and accepted output), each mapped to where it last occurred with a token after it.
A draft is what followed the latest earlier occurrence of the longest n-gram that ends the history:
a model that quotes or edits its prompt (code with a name changed, a summary with quotes)
continues it that way, and the chain verifies the draft in one step (`SequenceInput.draft`).
The index grows with each accepted token in O(MAX_NGRAM), so drafting never rescans the history.

A miss costs the chain the drafted positions it verified for nothing, so the draft's length
adapts to how the sequence's drafts fare: it halves after a draft wholly rejected and doubles
after one wholly accepted, from 1 up to the caller's bound. An answer that quotes keeps long
drafts; one that does not drafts a token or two. A single token that occurred before is no
draft: what followed it is seldom what follows now, and a step that verifies even one drafted
token costs a lone stream about 1.5x a step of one token on CPU (two rows of each product
against one). Replayed over the greedy answers of `layerline bench speculate`'s prompts with
those costs (SmolLM2, two threads, Intel Xeon), drafts from bigrams and trigrams only decoded
1.88x as fast as plain steps on the quoting prompts and 0.99x on the ordinary ones, against
1.63x and 0.91x with unigrams too.

Knows nothing of steps, chains or the wire; the drafted tokens are guesses the last stage checks.
"""

from __future__ import annotations

from layerline.shared.sampling import MAX_SPECULATE

MAX_NGRAM = 3  # the longest suffix looked up; longer ones rarely find more and cost more to index
MIN_NGRAM = 2  # the shortest: what followed one token is too seldom what follows it again


class PromptLookup:
    """The n-gram index of one growing token history."""

    def __init__(self) -> None:
        self._tokens: list[int] = []
        # n-gram -> index of the token that followed its latest occurrence
        self._after: dict[tuple[int, ...], int] = {}
        self.length = MAX_SPECULATE  # the next draft's length at most, adapted by `verified`

    def extend(self, tokens: list[int]) -> None:
        """Take the history's tokens past those already indexed (the history only grows)."""
        for token in tokens[len(self._tokens) :]:
            end = len(self._tokens)  # `token` follows every n-gram that ends here
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                self._after[tuple(self._tokens[end - n : end])] = end
            self._tokens.append(token)

    def draft(self, history: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest n-gram
        ending `history` (which must start with what was indexed); [] when none occurred."""
        self.extend(history)
        tokens = self._tokens
        k = min(k, self.length)
        if k <= 0:
            return []
        for n in range(min(MAX_NGRAM, len(tokens) - 1), MIN_NGRAM - 1, -1):
            start = self._after.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + k]
        return []

    def verified(self, drafted: int, accepted: int) -> None:
        """How the last draft fared: its next one is half as long after a wholly rejected draft,
        twice as long after a wholly accepted one (from 1 up to MAX_SPECULATE)."""
        if drafted and not accepted:
            self.length = max(1, drafted // 2)
        elif drafted and accepted == drafted:
            self.length = min(MAX_SPECULATE, 2 * max(self.length, drafted))
