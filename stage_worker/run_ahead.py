"""A first stage's head start: the next decode step computed before the coordinator asks for it.

Between two decode steps of a lone stream, the sampled token travels to the coordinator, which
appends it, plans the next step and sends its header back to the first stage: about 1.1-1.3 ms a
token on a 1-stage chain on 2 cores (a 10.5 ms bfloat16 SmolLM2 step), while the stage sits idle.
A step whose header says `run_ahead` (the coordinator's word that, unless the sequence ends, its
next step continues it with the token it draws: at depth 1 a request that arrives meanwhile waits
for that step) lets the first stage
start that next step at once on its compute thread, as a guess, as soon as it knows the token:
its own draw on a 1-stage chain, else the last stage's acknowledgement of the step, which then
carries it. When the real header arrives it is compared with the guess: the same sequences,
positions, tokens and sampling, nothing released, the same route. If so the guess's output is
the step's, computed already; any other task on the compute thread (a different step, a release,
a readiness probe, an orphan sweep) first drops the positions the guess wrote from the KV cache
(`PagedKVCache.truncate`, as a rejected draft's are). A wrong guess costs the cores one step, and
the task that found it waits for it to end; a token that ends the sequence is never guessed on.

Owns `Guess` (what was guessed and its output), `guess` (the next step a computed one implies,
or None) and `enabled` (LAYERLINE_RUN_AHEAD: `auto`, the default, or `off`).

Knows nothing of frames, of gRPC or of the coordinator. `Guess.undo` runs on the compute thread;
`guess` also on the event loop, on what the compute thread is done with.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from .engine import SequenceStep, StageEngine, StepOutput

ENV = "LAYERLINE_RUN_AHEAD"


def enabled() -> bool:
    """Whether LAYERLINE_RUN_AHEAD lets a stage run ahead (its default `auto` does)."""
    return os.environ.get(ENV, "auto") != "off"


@dataclass(frozen=True)
class Guess:
    """A step computed before it was asked for, and the route it was guessed for."""

    seqs: tuple[SequenceStep, ...]
    chain: str
    alone: bool
    out: StepOutput

    def matches(self, seqs: Sequence[SequenceStep], *, chain: str, alone: bool, releases: int) -> bool:
        """Whether a received step is this one: then its output is the guess's."""
        return not releases and chain == self.chain and alone == self.alone and tuple(seqs) == self.seqs

    def undo(self, engine: StageEngine) -> None:
        """Drop the KV positions the guess wrote, where its sequences still hold them."""
        for seq in self.out.kept:
            engine.rewind(seq.sequence_id, seq.positions[0])


def guess(
    seqs: Sequence[SequenceStep], out: StepOutput, drawn: Mapping[str, int], *, ends: Collection[int] = ()
) -> tuple[SequenceStep, ...] | None:
    """The decode step that follows `out` when each of its sequences goes on with the token it
    drew (`drawn`, by sequence id), or None: a sequence that failed here, drew nothing or a token
    that `ends` it (end of sequence), verified drafts or reads its history (the repetition
    penalty) makes no guess."""
    if out.errors or out.accepted or len(out.kept) != len(seqs) or not seqs:
        return None
    following = []
    for seq in out.kept:
        token = drawn.get(seq.sequence_id)
        if token is None or token in ends or seq.history or seq.draft:
            return None
        position = seq.positions[-1] + 1
        following.append(replace(seq, positions=(position,), token_ids=(token,), prefix_from="", rewind=False))
    return tuple(following)
