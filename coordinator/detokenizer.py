"""Streaming text out: token ids to text deltas, and stop strings cut out of those deltas.

This module owns the two pieces of state a streamed answer needs between tokens: the text not yet
released because it ends inside a UTF-8 character (`IncrementalDetokenizer`, a thin wrapper over
`tokenizers.decoders.DecodeStream`, which keeps the short window of ids in Rust), and the tail of
text held back because it may be the start of a stop string (`StopMatcher`).

DecodeStream alone is not enough for one case: it has no flush, so text it holds when generation
ends (a trailing partial character, which `decode` writes as U+FFFD) would be lost and the random-id
test in tests/test_text.py would fail; `flush` supplies that text from one `decode` of the ids.

It knows nothing of how ids are made (the tokenizer is a `TextModel`), of requests, of eos ids
or token limits (the caller decides when generation ends), nor of the network.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from tokenizers.decoders import DecodeStream

from .tokenizer import TextModel

MAX_STOP_STRINGS: Final = 16
MAX_STOP_STRING_CHARS: Final = 256


class IncrementalDetokenizer:
    """Turns generated token ids, pushed one at a time, into text deltas.

    The deltas joined, followed by `flush()`, equal `text_model.decode(generated_ids)`; no delta
    ends inside a UTF-8 character. `DecodeStream` does the windowed decoding; special tokens are
    dropped before it sees them, as `decode` drops them before its decoder runs.

    The text is that of the generated ids alone, as transformers decodes new tokens, so
    `prompt_ids` is deliberately not given to the stream as left context (`DecodeStream(ids=...)`):
    with SentencePiece-style tokenizers it would turn an answer's first "Hello" into " Hello", and
    the stream would no longer equal `decode(generated_ids)`. (With byte-level BPE, the embedded
    model's, it would change nothing.)
    """

    def __init__(self, text_model: TextModel, prompt_ids: Sequence[int]) -> None:
        self._text_model = text_model
        self._skipped = text_model.special_token_ids  # decode drops these: the stream never sees them
        self._stream = DecodeStream(skip_special_tokens=True)
        self._ids: list[int] = []  # the generated ids, special tokens dropped: what flush decodes
        self._released = 0  # characters of decode(self._ids) returned so far
        self._holding = False  # the stream has ids whose text it has not returned yet

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" while a character is partial)."""
        if token_id in self._skipped:
            return ""
        self._ids.append(token_id)
        delta = self._stream.step(self._text_model.tokenizer, token_id)
        self._holding = delta is None
        if delta is None:
            return ""
        self._released += len(delta)
        return delta

    def flush(self) -> str:
        """The text still held back (a trailing partial character decodes as U+FFFD), at the end."""
        if not self._holding:
            return ""
        self._holding = False
        return self._text_model.decode(self._ids)[self._released :]


class StopMatcher:
    """Cuts a stream of text deltas at the first stop string; the stop string is not output.

    `push` releases the text that can no longer be part of a stop string and holds back the
    longest tail that is the start of one. When a stop string completes, `stopped` turns true,
    `push` returns the text before the stop string, and everything after is dropped. If two stop
    strings match, the one that completes first in the stream wins (so the result does not depend
    on how the text was cut into deltas); among those, the one that starts first. At the end of a
    generation that did not stop, `flush` returns the held text.
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        if isinstance(stop_strings, str):
            raise ValueError("stop: must be a list of strings, not one string")
        if len(stop_strings) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop_strings)}")
        for i, stop in enumerate(stop_strings):
            if not isinstance(stop, str):
                raise ValueError(f"stop[{i}]: must be a string, got {type(stop).__name__}")
            if not stop:
                raise ValueError(f"stop[{i}]: must not be empty")
            if len(stop) > MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop[{i}]: at most {MAX_STOP_STRING_CHARS} characters, got {len(stop)}")
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stop_strings))
        self._held = ""
        self._matched: str | None = None

    @property
    def stopped(self) -> bool:
        """True once a stop string has completed; further text is dropped."""
        return self._matched is not None

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the stream, if one did."""
        return self._matched

    def push(self, delta: str) -> str:
        """Add streamed text; return the part that is now safe to output."""
        if self._matched is not None:
            return ""
        if not self._stops:
            return delta
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, self._matched = match
            self._held = ""
            return text[:start]
        cut = len(text) - self._partial_length(text)
        self._held = text[cut:]
        return text[:cut]

    def flush(self) -> str:
        """The held text, at the end of a generation that did not stop on a stop string."""
        held, self._held = self._held, ""
        return "" if self._matched is not None else held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the match that ends first in `text` (ties: the one starting first)."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = text.find(stop)
            if start != -1 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _partial_length(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            # Candidate tails start where stop's first character occurs, no further back than
            # len(stop) - 1 characters; the first candidate that fits is this stop's longest.
            start = text.find(stop[0], max(len(text) - len(stop) + 1, 0))
            while start != -1 and len(text) - start > longest:
                if stop.startswith(text[start:]):
                    longest = len(text) - start
                    break
                start = text.find(stop[0], start + 1)
        return longest
