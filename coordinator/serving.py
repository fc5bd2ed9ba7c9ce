"""The one path from a client's request to its generation, whatever API it came by.

Owns the checks every request passes whatever its wire (the sampling values, `max_tokens`, the
stop strings, the model; every refusal names the field and the limit), admission (a rate limit
with asyncio-throttle and a bounded queue in front of the generation slots; past the bound
`QueueFull`, with a retry hint), tokenizing off the event loop once admitted, placing the
sequence on the cluster, the request's telemetry, and freeing its slot and its KV however it
ends (a finished answer, a refusal, a failure, or a client that went away). A request is checked
in the order of what each check costs: the model, sampling and the queue bound, then the rate
limit; only then is it tokenized and its token count checked.

The gRPC servicer and the HTTP API decode their messages into a `Request`, iterate `generate`,
and map its typed errors to their own statuses. Knows nothing of gRPC, HTTP or torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from asyncio_throttle import Throttler

from layerline.shared.errors import Code, InvalidInput, NoCapacity, Unreachable, status_of
from layerline.shared.sampling import MAX_SPECULATE, SamplingParams

from .cluster import Cluster
from .generation import Delta, Failed, Finished, Generation, Limits
from .requests import Admission, PromptEncoder
from .telemetry import CoordinatorTelemetry, RequestTelemetry
from .text import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, TextModel


class UnknownModel(InvalidInput):
    """The request names a model this coordinator does not serve."""


class QueueFull(NoCapacity):
    """Too many requests wait for a generation slot; the caller may retry after `retry_after_ms`."""

    retry_after_ms = 1000


class GenerationFailed(Exception):
    """The generation ended with an error after it was admitted (`code` says which kind)."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Request:
    """One request, decoded from its wire: what to tokenize, and how to sample."""

    operation: str  # "text_completion" or "chat" (the telemetry's gen_ai.operation.name)
    encode: Callable[[], Awaitable[list[int]]]  # its prompt or chat to token ids, off the event loop
    sampling: SamplingParams
    max_tokens: int | None = None  # None: the coordinator's default
    speculate: int | None = None  # tokens drafted per step at most; None: the coordinator's --speculate
    stop: list[str] = field(default_factory=list)
    model: str = ""  # its name or id; "": the one model served
    metadata: Iterable[tuple[str, str | bytes]] | None = None  # the call's headers (trace context)


Event = Delta | Finished


class Serving:
    def __init__(
        self,
        cluster: Cluster,
        text: TextModel,
        *,
        admission: Admission,
        model_name: str,
        telemetry: CoordinatorTelemetry,
        speculate: int = 0,
    ) -> None:
        self.cluster = cluster
        self.text = text
        self.admission = admission
        self.model_name = model_name
        self.telemetry = telemetry
        self.speculate = speculate  # tokens drafted per step at most for a request that does not say
        self.encoder = PromptEncoder(text, admission)
        self._slots = asyncio.Semaphore(admission.max_active)
        self._throttler = Throttler(rate_limit=max(1, int(admission.rate_limit)), period=1.0)
        self.active = 0  # requests generating
        self.queued = 0  # requests admitted and waiting to be tokenized or for a slot

    def served(self) -> set[str]:
        """The names and ids a request may give as its model."""
        return {self.model_name} | {c.workers[0].model_id for c in self.cluster.chains}

    async def generate(self, request: Request) -> AsyncGenerator[Event, None]:
        """The request's answer as it comes: `Delta`s, then one `Finished`.

        Raises `InvalidInput` (`UnknownModel` among them) for a request that can never pass,
        `QueueFull` for one that may pass later, `NoChainError` when no chain serves, and
        `GenerationFailed` for a generation that failed once admitted. The request's telemetry
        covers every way it ends, a client that went away included."""
        sequence_id = uuid.uuid4().hex
        observed = self.telemetry.request(
            request.metadata, operation=request.operation, prompt_tokens=0, sequence_id=sequence_id
        )
        try:
            async with contextlib.aclosing(self._serve(request, sequence_id, observed)) as events:
                async for event in events:
                    yield event
        except (InvalidInput, NoCapacity, Unreachable) as err:
            observed.failed(status_of(err).name, str(err))
            raise
        except GenerationFailed as err:
            observed.failed(err.code.name, err.message)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            observed.failed("CANCELLED", "the client went away", cancelled=True)
            raise
        finally:
            observed.end()

    async def _serve(
        self, request: Request, sequence_id: str, observed: RequestTelemetry
    ) -> AsyncGenerator[Event, None]:
        sampling, max_tokens, stop = self.checked(request)
        speculate = self.speculate if request.speculate is None else request.speculate
        observed.set_sampling(sampling, max_tokens=max_tokens)
        # Every slot taken and max_queued more on their way to one (tokenizing or waiting): a request
        # tokenizing while a slot is free is headed for that slot, so a burst admits max_active + max_queued
        # however fast its first requests tokenize.
        limit = self.admission.max_active + self.admission.max_queued
        if self.active + self.queued >= limit:
            raise QueueFull(
                f"{self.active} requests generate and {self.queued} wait (max_active = {self.admission.max_active}, "
                f"max_queued = {self.admission.max_queued}); retry later"
            )
        self.queued += 1
        try:
            async with self._throttler:
                ids = await request.encode()
                _tokenized(observed, len(ids))
                self._fits(ids, max_tokens)
                await self._slots.acquire()
        finally:
            self.queued -= 1
        self.active += 1
        gen = Generation(
            sequence_id=sequence_id,
            prompt_ids=ids,
            sampling=sampling,
            limits=Limits(max_tokens=max_tokens, max_context=self.admission.max_context),
            text=self.text,
            stop=stop,
            on_token_at=observed.on_token,
            speculate=speculate,
        )
        observed.admitted(gen.sequence)
        try:
            self.cluster.place(gen.sequence)
            async for event in gen.events():
                if isinstance(event, Failed):
                    raise GenerationFailed(event.code, event.message)
                if isinstance(event, Finished):
                    observed.finished(event.reason)
                yield event
        finally:
            self.cluster.finish(gen.sequence)
            self.active -= 1
            self._slots.release()

    def checked(self, request: Request) -> tuple[SamplingParams, int, list[str]]:
        """The request's sampling, max_tokens and stop strings, each checked; InvalidInput names the field."""
        if request.model and request.model not in self.served():
            raise UnknownModel(
                f"model {request.model!r} is not served here; this coordinator serves {self.model_name!r}"
            )
        max_tokens = request.max_tokens if request.max_tokens is not None else self.admission.default_max_tokens
        if max_tokens < 1:
            raise InvalidInput(f"max_tokens = {max_tokens} must be >= 1")
        stop = request.stop
        if len(stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise InvalidInput(
                f"stop takes at most {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_STRING_CHARS} characters"
            )
        request.sampling.check()
        if request.speculate is not None and not 0 <= request.speculate <= MAX_SPECULATE:
            raise InvalidInput(f"speculate = {request.speculate} must be in [0, {MAX_SPECULATE}] (0: off)")
        return request.sampling, max_tokens, stop

    def _fits(self, ids: list[int], max_tokens: int) -> None:
        if len(ids) + max_tokens > self.admission.max_context:
            raise InvalidInput(
                f"prompt of {len(ids)} tokens plus max_tokens = {max_tokens} exceeds the context "
                f"length of {self.admission.max_context} tokens"
            )

    def close(self) -> None:
        self.encoder.close()


def _tokenized(observed: RequestTelemetry, prompt_tokens: int) -> None:
    """Tell the request's telemetry its prompt's size, known only once it is tokenized (after the
    request's span began): its counter reads it at admission, its span gets it now."""
    observed.prompt_tokens = prompt_tokens
    if observed.span is not None:
        observed.span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
