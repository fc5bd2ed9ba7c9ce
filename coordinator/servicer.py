"""The coordinator's gRPC services: `Coordinator` for clients, `Registry` for stage workers.

Owns decoding requests into plain values, checking them (every refusal names the field and the
limit; `requests` holds the bounds of prompts and chats, and tokenizes them), admission (a rate
limit with asyncio-throttle and a bounded queue in front of the generation slots; past the
bound, RESOURCE_EXHAUSTED with a retry hint) and encoding the streamed answer. A request is
checked in the order of what each check costs: the prompt's size and the chat's shape first,
then the model, sampling and the queue bound, then the rate limit; only then is it tokenized,
off the event loop, and its token count checked. The work itself is the cluster's and the
generation's.

Knows nothing of torch or tensors.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NoReturn

import grpc
from asyncio_throttle import Throttler

from layerline.protos.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from layerline.shared.errors import InvalidInput, NoCapacity, status_of
from layerline.shared.rpc import PUSHBACK_KEY, RETRY_AFTER_KEY, grpc_status
from layerline.shared.sampling import SamplingParams
from layerline.shared.wire import sampling_from_wire

from .cluster import Cluster, NoChainError
from .generation import Delta, Failed, Finished, Generation, Limits
from .members import worker_info
from .requests import Admission, PromptEncoder, check_chat, check_prompt
from .telemetry import CoordinatorTelemetry, RequestTelemetry
from .text import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, TextModel

log = logging.getLogger(__name__)

FINISH = {"stop": coordinator_pb2.FINISH_REASON_STOP, "length": coordinator_pb2.FINISH_REASON_LENGTH}


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(
        self,
        cluster: Cluster,
        text: TextModel,
        *,
        admission: Admission,
        model_name: str,
        telemetry: CoordinatorTelemetry,
    ) -> None:
        self.cluster = cluster
        self.text = text
        self.admission = admission
        self.model_name = model_name
        self.telemetry = telemetry
        self._slots = asyncio.Semaphore(admission.max_active)
        self._throttler = Throttler(rate_limit=max(1, int(admission.rate_limit)), period=1.0)
        self.encoder = PromptEncoder(text, admission)
        self.active = 0
        self.queued = 0

    async def Generate(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        try:
            check_prompt(request.prompt, self.admission)
        except InvalidInput as err:
            await _abort(context, err)
        prompt = request.prompt
        async for response in self._generate(
            lambda: self.encoder.prompt(prompt),
            request.sampling,
            context,
            model=request.model,
            operation="text_completion",
        ):
            yield response

    async def Chat(
        self, request: coordinator_pb2.ChatRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        try:
            chat = check_chat(request.messages, self.admission)
        except InvalidInput as err:
            await _abort(context, err)
        async for response in self._generate(
            lambda: self.encoder.chat(chat), request.sampling, context, model=request.model, operation="chat"
        ):
            yield response

    async def _generate(
        self,
        encode: Callable[[], Awaitable[list[int]]],
        params: common_pb2.SamplingParams,
        context: grpc.aio.ServicerContext,
        *,
        model: str,
        operation: str,
    ) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        """One request under its telemetry: its span and latencies cover every way it can end.
        `encode` tokenizes the request's prompt (off the event loop) once it is admitted."""
        sequence_id = uuid.uuid4().hex
        observed = self.telemetry.request(
            context.invocation_metadata(), operation=operation, prompt_tokens=0, sequence_id=sequence_id
        )
        try:
            async for response in self._serve(
                encode, params, context, model=model, sequence_id=sequence_id, observed=observed
            ):
                yield response
        except grpc.aio.AbortError:
            observed.failed(context.code().name, context.details())
            raise
        except (asyncio.CancelledError, GeneratorExit):
            observed.failed("CANCELLED", "the client went away", cancelled=True)
            raise
        finally:
            observed.end()

    async def _serve(
        self,
        encode: Callable[[], Awaitable[list[int]]],
        params: common_pb2.SamplingParams,
        context: grpc.aio.ServicerContext,
        *,
        model: str,
        sequence_id: str,
        observed: RequestTelemetry,
    ) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        try:
            sampling, max_tokens, stop = self._admissible(params, model=model, observed=observed)
        except (InvalidInput, NoCapacity) as err:
            await _abort(context, err)
        self.queued += 1
        try:
            async with self._throttler:
                ids = await encode()
                _tokenized(observed, len(ids))
                self._fits(ids, max_tokens)
                await self._slots.acquire()
        except InvalidInput as err:
            await _abort(context, err)
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
        )
        observed.admitted(gen.sequence)
        try:
            try:
                self.cluster.place(gen.sequence)
            except NoChainError as err:
                await _abort(context, err)
            async for event in gen.events():
                if isinstance(event, Delta):
                    yield _delta(event)
                elif isinstance(event, Finished):
                    observed.finished(event.reason)
                    yield coordinator_pb2.GenerateResponse(
                        finish_reason=FINISH[event.reason],
                        usage=coordinator_pb2.Usage(
                            prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens
                        ),
                    )
                elif isinstance(event, Failed):
                    await context.abort(grpc_status(event.code), event.message)
        finally:
            self.cluster.finish(gen.sequence)
            self.active -= 1
            self._slots.release()

    def _admissible(
        self, params: common_pb2.SamplingParams, *, model: str, observed: RequestTelemetry
    ) -> tuple[SamplingParams, int, list[str]]:
        """The request's sampling, max_tokens and stop strings; InvalidInput or QueueFull if it cannot wait."""
        served = {self.model_name} | {c.workers[0].model_id for c in self.cluster.chains}
        if model and model not in served:
            raise InvalidInput(f"model {model!r} is not served here; this coordinator serves {self.model_name!r}")
        sampling, max_tokens, stop = self._sampling(params)
        observed.set_sampling(sampling, max_tokens=max_tokens)
        if self.queued >= self.admission.max_queued:
            raise QueueFull(
                f"{self.queued} requests already wait (max_queued = {self.admission.max_queued}); retry later"
            )
        return sampling, max_tokens, stop

    def _fits(self, ids: list[int], max_tokens: int) -> None:
        if len(ids) + max_tokens > self.admission.max_context:
            raise InvalidInput(
                f"prompt of {len(ids)} tokens plus max_tokens = {max_tokens} exceeds the context "
                f"length of {self.admission.max_context} tokens"
            )

    def _sampling(self, p: common_pb2.SamplingParams) -> tuple[SamplingParams, int, list[str]]:
        max_tokens = p.max_tokens if p.HasField("max_tokens") else self.admission.default_max_tokens
        if max_tokens < 1:
            raise InvalidInput(f"max_tokens = {max_tokens} must be >= 1")
        stop = list(p.stop)
        if len(stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise InvalidInput(
                f"stop takes at most {MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_STRING_CHARS} characters"
            )
        sampling = sampling_from_wire(p)
        sampling.check()
        return sampling, max_tokens, stop

    async def ListModels(
        self, request: coordinator_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ListModelsResponse:
        self.cluster.refresh()
        by_id: dict[str, int] = {}
        for chain in self.cluster.chains:
            by_id[chain.workers[0].model_id] = by_id.get(chain.workers[0].model_id, 0) + 1
        return coordinator_pb2.ListModelsResponse(
            models=[
                coordinator_pb2.ModelInfo(
                    model_id=mid,
                    model_name=self.model_name,
                    num_layers=self.cluster.registry.num_layers,
                    ready_replicas=n,
                )
                for mid, n in by_id.items()
            ]
        )

    async def ClusterStatus(
        self, request: coordinator_pb2.ClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ClusterStatusResponse:
        self.cluster.refresh()
        registry = self.cluster.registry
        response = coordinator_pb2.ClusterStatusResponse(
            active_requests=self.active,
            queued_requests=self.queued,
            failovers=self.cluster.failovers,
            last_failover_gap_seconds=self.cluster.last_failover_gap,
            max_failover_gap_seconds=self.cluster.max_failover_gap,
            shared_prefix_tokens=self.cluster.shared_prefix_tokens,
            preemptions=self.cluster.preemptions,
            stalls=self.cluster.stalls,
        )
        for w in registry.workers():
            entry = response.workers.add(
                worker=worker_info(w), seconds_since_heartbeat=registry.seconds_since(w.address)
            )
            chain = self.cluster.chain_of(w.address)
            if chain is not None:
                entry.replica = chain.replica
                entry.kv_blocks_cached = chain.scheduler.cached_blocks(max(w.kv_block_size, 1))
        for chain in self.cluster.chains:
            response.chains.add(
                replica=chain.replica,
                model_id=chain.workers[0].model_id,
                addresses=chain.addresses,
                active_sequences=chain.scheduler.load,
                cached_prefixes=len(chain.scheduler.cached),
                cached_prefix_tokens=chain.scheduler.cached_tokens,
            )
        return response


class QueueFull(NoCapacity):
    """Too many requests wait for a generation slot; the caller may retry after `retry_after_ms`."""

    retry_after_ms = 1000


async def _abort(context: grpc.aio.ServicerContext, err: Exception) -> NoReturn:
    """End the call with the status of `err`'s kind (`errors.STATUS_OF`) and its message; a refusal
    that may pass later carries the retry hint in both trailers (ours and gRPC's standard one)."""
    hint = getattr(err, "retry_after_ms", None)
    trailers = () if hint is None else ((RETRY_AFTER_KEY, str(hint)), (PUSHBACK_KEY, str(hint)))
    await context.abort(grpc_status(status_of(err)), str(err), trailing_metadata=trailers)
    raise AssertionError("context.abort returns only by raising")


def _tokenized(observed: RequestTelemetry, prompt_tokens: int) -> None:
    """Tell the request's telemetry its prompt's size, known only once it is tokenized (after the
    request's span began): its counter reads it at admission, its span gets it now."""
    observed.prompt_tokens = prompt_tokens
    if observed.span is not None:
        observed.span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)


def _delta(event: Delta) -> coordinator_pb2.GenerateResponse:
    response = coordinator_pb2.GenerateResponse(text=event.text, token_ids=event.token_ids)
    for logprob, top in event.logprobs:
        entry = response.logprobs.add(logprob=logprob or 0.0)
        entry.top_logprobs.extend(common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in top)
    return response
