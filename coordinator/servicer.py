"""The coordinator's client API over gRPC: the `Coordinator` service.

Owns decoding requests into plain values (a prompt's or a chat's shape is checked first, by
`requests`: its size in bytes, its messages), handing them to `Serving` (the one path every API
takes to a generation: the remaining checks, admission, the work), and encoding the streamed
answer; every refusal ends the call with the status of its kind and its message, and a refusal
that may pass later carries a retry hint in its trailers.

Knows nothing of torch or tensors.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc

from layerline.protos.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc
from layerline.shared.errors import InvalidInput, NoCapacity, Unreachable, status_of
from layerline.shared.rpc import PUSHBACK_KEY, RETRY_AFTER_KEY, grpc_status
from layerline.shared.wire import sampling_from_wire

from .generation import Delta, Finished
from .members import worker_info
from .requests import check_chat, check_prompt
from .serving import GenerationFailed, Request, Serving

log = logging.getLogger(__name__)

FINISH = {"stop": coordinator_pb2.FINISH_REASON_STOP, "length": coordinator_pb2.FINISH_REASON_LENGTH}


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        self.cluster = serving.cluster
        self.model_name = serving.model_name

    @property
    def active(self) -> int:
        return self.serving.active

    @property
    def queued(self) -> int:
        return self.serving.queued

    async def Generate(
        self, request: coordinator_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        try:
            check_prompt(request.prompt, self.serving.admission)
        except InvalidInput as err:
            await _abort(context, err)
        prompt = request.prompt
        encode = self.serving.encoder.prompt
        async for response in self._generate(
            lambda: encode(prompt), request.sampling, context, model=request.model, operation="text_completion"
        ):
            yield response

    async def Chat(
        self, request: coordinator_pb2.ChatRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        try:
            chat = check_chat(request.messages, self.serving.admission)
        except InvalidInput as err:
            await _abort(context, err)
        encode = self.serving.encoder.chat
        async for response in self._generate(
            lambda: encode(chat), request.sampling, context, model=request.model, operation="chat"
        ):
            yield response

    async def _generate(
        self,
        encode: Callable[[], Any],
        params: common_pb2.SamplingParams,
        context: grpc.aio.ServicerContext,
        *,
        model: str,
        operation: str,
    ) -> AsyncIterator[coordinator_pb2.GenerateResponse]:
        try:
            request = Request(
                operation=operation,
                encode=encode,
                sampling=sampling_from_wire(params),
                max_tokens=params.max_tokens if params.HasField("max_tokens") else None,
                speculate=params.speculate if params.HasField("speculate") else None,
                stop=list(params.stop),
                model=model,
                metadata=context.invocation_metadata(),
            )
            async with contextlib.aclosing(self.serving.generate(request)) as events:
                async for event in events:
                    if isinstance(event, Delta):
                        yield _delta(event)
                    elif isinstance(event, Finished):
                        yield coordinator_pb2.GenerateResponse(
                            finish_reason=FINISH[event.reason],
                            usage=coordinator_pb2.Usage(
                                prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens
                            ),
                        )
        except (InvalidInput, NoCapacity, Unreachable) as err:
            await _abort(context, err)
        except GenerationFailed as err:
            await context.abort(grpc_status(err.code), err.message)

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
            prefix_cache_queries=self.cluster.prefix_queries,
            spec_decode_draft_tokens=self.cluster.draft_tokens,
            spec_decode_accepted_tokens=self.cluster.accepted_tokens,
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


async def _abort(context: grpc.aio.ServicerContext, err: Exception) -> NoReturn:
    """End the call with the status of `err`'s kind (`errors.STATUS_OF`) and its message; a refusal
    that may pass later carries the retry hint in both trailers (ours and gRPC's standard one)."""
    hint = getattr(err, "retry_after_ms", None)
    trailers = () if hint is None else ((RETRY_AFTER_KEY, str(hint)), (PUSHBACK_KEY, str(hint)))
    await context.abort(grpc_status(status_of(err)), str(err), trailing_metadata=trailers)
    raise AssertionError("context.abort returns only by raising")


def _delta(event: Delta) -> coordinator_pb2.GenerateResponse:
    response = coordinator_pb2.GenerateResponse(text=event.text, token_ids=event.token_ids)
    for logprob, top in event.logprobs:
        entry = response.logprobs.add(logprob=logprob or 0.0)
        entry.top_logprobs.extend(common_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in top)
    return response
