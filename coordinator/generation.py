"""One request's generation: tokens in from the chain, text deltas out to the client.

Owns a request's stopping rules (max_tokens, end-of-sequence tokens, stop strings, the
context length), its incremental detokenization, and the events its client stream is made
of. A `Generation` is fed by its `Sequence`'s callbacks on the event loop and read by the
servicer through `events()`.

Knows nothing of gRPC messages, chains or the schedule.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from layerline.shared.errors import Code
from layerline.shared.sampling import SamplingParams

from .steps import Sequence
from .text import IncrementalDetokenizer, StopMatcher, TextModel


@dataclass(frozen=True)
class Delta:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[tuple[float | None, tuple[tuple[int, float], ...]], ...] = ()


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    code: Code
    message: str


Event = Delta | Finished | Failed


@dataclass
class Limits:
    max_tokens: int  # tokens to generate at most
    max_context: int  # prompt plus generated tokens at most (the model's positions)


@dataclass
class Generation:
    sequence_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    limits: Limits
    text: TextModel
    stop: list[str] = field(default_factory=list)
    on_token_at: Callable[[float], None] | None = None  # called with each new token's time (telemetry)
    speculate: int = 0  # tokens drafted by prompt lookup that a step verifies at most; 0: off

    def __post_init__(self) -> None:
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._detok = IncrementalDetokenizer(self.text, self.prompt_ids)
        self._stops = StopMatcher(self.stop)
        self.finished = False
        self.sequence = Sequence(
            sequence_id=self.sequence_id,
            prompt=list(self.prompt_ids),
            sampling=self.sampling,
            on_token=self._on_token,
            on_error=self._on_error,
            speculate=self.speculate,
            max_generated=min(self.limits.max_tokens, self.limits.max_context - len(self.prompt_ids)),
        )
        self._pending_ids: list[int] = []
        self._pending_logprobs: list[tuple[float | None, tuple[tuple[int, float], ...]]] = []

    def _on_token(self, token_id: int, logprob: float | None, top: list[tuple[int, float]]) -> None:
        if self.finished:
            return
        if self.on_token_at is not None:
            self.on_token_at(time.monotonic())
        generated = len(self.sequence.generated)
        self._pending_ids.append(token_id)
        if self.sampling.logprobs is not None:
            self._pending_logprobs.append((logprob, tuple(top)))
        if token_id in self.text.eos_token_ids:
            self._finish("stop", emit=self._stops.push(self._detok.flush()) + self._stops.flush())
            return
        text = self._stops.push(self._detok.push(token_id))
        if self._stops.stopped:
            self._finish("stop", emit=text)
            return
        if generated >= self.limits.max_tokens or len(self.sequence.history) >= self.limits.max_context:
            self._finish("length", emit=text + self._stops.push(self._detok.flush()) + self._stops.flush())
            return
        if text:
            self._emit(text)

    def _emit(self, text: str) -> None:
        self._events.put_nowait(Delta(text, tuple(self._pending_ids), tuple(self._pending_logprobs)))
        self._pending_ids, self._pending_logprobs = [], []

    def _finish(self, reason: str, *, emit: str) -> None:
        if emit or self._pending_ids:
            self._emit(emit)
        self.finished = True
        self.sequence.done = True  # no further step is planned for it, even before it is released
        self.sequence.complete = True  # its KV may stay on the chain as a lender (the prefix cache)
        self._events.put_nowait(Finished(reason, len(self.prompt_ids), len(self.sequence.generated)))

    def _on_error(self, code: Code, message: str) -> None:
        if not self.finished:
            self.finished = True
            self.sequence.done = True
            self._events.put_nowait(Failed(code, message))

    def fail(self, code: Code, message: str) -> None:
        self._on_error(code, message)

    async def events(self) -> AsyncIterator[Event]:
        while True:
            event = await self._events.get()
            yield event
            if isinstance(event, (Finished, Failed)):
                return
