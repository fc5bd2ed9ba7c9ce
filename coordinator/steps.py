"""What the coordinator's scheduler and a chain exchange: sequences, the steps planned from them,
and what comes back.

Owns a sequence's record (its token history, the ground truth its KV can be rebuilt from, and
how far the chain holds it) and the name its KV has on the stages: the request's id, suffixed
with the placement after a move or a preemption, so a release of the KV it had before can never
free, or mix with, the KV it is rebuilding. Knows nothing of gRPC, text or the schedule.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from layerline.shared.errors import Code
from layerline.shared.sampling import SamplingParams

from .prompt_lookup import PromptLookup

_arrivals = itertools.count()


@dataclass
class Sequence:
    """A sequence's token history (the ground truth its KV can be rebuilt from) and progress."""

    sequence_id: str
    prompt: list[int]
    sampling: SamplingParams
    on_token: Callable[[int, float | None, list[tuple[int, float]]], None]  # called per new token
    on_error: Callable[[Code, str], None]  # (status, message)
    generated: list[int] = field(default_factory=list)
    fed: int = 0  # tokens of the history whose KV the chain holds
    kv_tokens: int = 0  # positions its KV takes on the chain once its step in flight returns
    in_flight: bool = False
    lent: int = 0  # steps in flight that copy a prefix of its KV: it is released after them
    done: bool = False
    complete: bool = False  # ended normally (a stop or its length), not cancelled or failed
    moves: int = 0  # times it was moved to another chain after a failure
    preemptions: int = 0  # times its KV was freed for an older sequence's and rebuilt
    refusals: int = 0  # times a stage had no room for it though the ledger had
    not_before: float = 0.0  # monotonic time before which it does not start again (after a refusal)
    placement: int = 0  # moves and preemptions so far: each starts its KV under a new name
    arrival: int = field(default_factory=lambda: next(_arrivals))  # admission order: the youngest yields first
    failed_at: float | None = None  # when its chain failed, until its next token arrives
    trace_context: dict[str, str] = field(default_factory=dict)
    speculate: int = 0  # tokens drafted by prompt lookup that a step may verify at most; 0: off
    max_generated: int | None = None  # tokens it may generate at most (no draft runs past them)
    lookup: PromptLookup = field(default_factory=PromptLookup)  # its history's n-grams, for drafts

    @property
    def history(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def kv_id(self) -> str:
        """The name of its KV on the stages of its current placement."""
        return self.sequence_id if not self.placement else f"{self.sequence_id}.{self.placement}"

    def replace_kv(self) -> str:
        """Forget the KV it holds (lost, or freed for another); returns the name it had there."""
        old = self.kv_id
        self.fed, self.kv_tokens, self.in_flight = 0, 0, False
        self.placement += 1
        return old


@dataclass(frozen=True)
class Slice:
    seq: Sequence
    start: int  # first position fed
    token_ids: tuple[int, ...]
    sample: bool  # the chain samples the token after this slice
    prefix_from: Sequence | None = None  # whose KV of positions [0, start) each stage copies first
    draft: tuple[int, ...] = ()  # tokens guessed after token_ids, fed with them for the last stage to verify
    rewind: bool = False  # the stages hold KV past `start` (of rejected drafted tokens): they drop it first


@dataclass(frozen=True)
class PlannedStep:
    slices: tuple[Slice, ...]
    release: tuple[str, ...] = ()  # KV (by name) each stage frees before this step's work
    alone: bool = False  # no other step of the chain is in flight: a large one may take more cores
    run_ahead: bool = False  # unless a sequence ends, the next step continues these, one drawn token each


@dataclass(frozen=True)
class Token:
    """One token the chain chose, with its logprobs when they were asked for."""

    token_id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Outcome:
    """What came back for one sequence of a step (`sequence_id`: the name of its KV)."""

    sequence_id: str
    token_id: int | None = None
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    error_code: Code = Code.OK
    error_message: str = ""
    accepted: tuple[Token, ...] = ()  # drafted tokens the chain accepted, before `token_id`


class StepSender(Protocol):
    def __call__(self, step: PlannedStep) -> Awaitable[list[Outcome]]: ...


class StepFailed(Exception):
    """A whole step failed (a hop is unreachable or the chain stalled); its sequences' KV on the
    chain is lost. `failed_address` names the hop when it is known."""

    def __init__(self, code: int, message: str, *, failed_address: str = "", since: float | None = None) -> None:
        super().__init__(message)
        self.code = Code.of(code)
        self.failed_address = failed_address
        self.since = since  # when the chain stopped answering (monotonic), for a stall; None: now
