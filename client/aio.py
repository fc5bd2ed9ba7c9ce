"""The asyncio client: `AsyncClient`, the mirror of `Client` on a grpc.aio channel.

Owns the asyncio channel, each call's deadline and trace metadata, making a call again while
`retry` says so (waiting with `asyncio.sleep`), and turning gRPC failures (also those in the
middle of a stream) into the typed errors of `layerline.client.errors`.
Knows nothing of the messages' fields or the options' limits: `wire` checks the options, builds
the requests and reads the answers. Create it inside the event loop that uses it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

import grpc
import grpc.aio

from layerline.protos.v1 import coordinator_pb2, coordinator_pb2_grpc
from layerline.shared.rpc import channel_options

from . import wire
from .errors import error_from_rpc
from .retry import DEFAULT_RETRIES, GENERATE_CODES, INFO_CODES, Attempts, Limits
from .tracing import call_metadata
from .types import Chunk, ClusterStatus, Completion, ModelInfo, RequestOptions
from .wire import INFO_TIMEOUT

if TYPE_CHECKING:  # typing_extensions is not a runtime dependency
    from typing_extensions import Unpack

_Response = TypeVar("_Response")
_StreamMethod = Callable[..., grpc.aio.UnaryStreamCall[wire.Request, coordinator_pb2.GenerateResponse]]


class AsyncClient:
    """A coordinator at `target` ("host:port"); `token`, `ca_cert`, `credentials` and `retries`
    as for `Client` (a retry waits with `asyncio.sleep`).

    `stream` and `chat_stream` return async iterators; leaving one early cancels the call once
    the iterator is closed (`contextlib.aclosing` closes it at once).
    """

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        ca_cert: str | os.PathLike[str] | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        retries: int = DEFAULT_RETRIES,
    ) -> None:
        self.target = target
        self.retries = wire.check_retries(retries)
        self._auth = wire.auth_metadata(token)  # sent with every call
        credentials = wire.channel_credentials(ca_cert, credentials)
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=channel_options())
        else:
            self._channel = grpc.aio.secure_channel(target, credentials, options=channel_options())
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)  # type: ignore[no-untyped-call]
        self._health_check: grpc.aio.UnaryUnaryMultiCallable[str, str] = self._channel.unary_unary(
            wire.HEALTH_CHECK_METHOD,
            request_serializer=wire.encode_health_request,
            response_deserializer=wire.decode_health_response,
        )

    async def generate(self, prompt: str, **options: Unpack[RequestOptions]) -> Completion:
        """Completes `prompt` and returns the whole answer.

        Options (`RequestOptions`): max_tokens, temperature (0 is greedy), top_p, top_k, min_p,
        repetition_penalty, seed, stop, logprobs, speculate; model; timeout (seconds for the whole call);
        retries (made again while no token has arrived; the client's by default).
        """
        return wire.completion_from([chunk async for chunk in self.stream(prompt, **options)])

    def stream(self, prompt: str, **options: Unpack[RequestOptions]) -> AsyncIterator[Chunk]:
        """Completes `prompt`, yielding the answer as it is generated; the last chunk has
        finish_reason and usage. Arguments are checked now; the call starts at the first step.

        Options (`RequestOptions`): max_tokens, temperature (0 is greedy), top_p, top_k, min_p,
        repetition_penalty, seed, stop, logprobs, speculate; model; timeout (seconds for the whole call);
        retries (made again while no token has arrived; the client's by default).
        """
        request, limits = wire.request_of(prompt, options, chat=False, retries=self.retries)
        return self._chunks(self._stub.Generate, request, limits)

    async def chat(self, messages: Sequence[Mapping[str, str]], **options: Unpack[RequestOptions]) -> Completion:
        """Answers a conversation (`[{"role": "user", "content": "Hi"}, ...]`) in one piece.

        Options (`RequestOptions`): max_tokens, temperature (0 is greedy), top_p, top_k, min_p,
        repetition_penalty, seed, stop, logprobs, speculate; model; timeout (seconds for the whole call);
        retries (made again while no token has arrived; the client's by default).
        """
        return wire.completion_from([chunk async for chunk in self.chat_stream(messages, **options)])

    def chat_stream(
        self, messages: Sequence[Mapping[str, str]], **options: Unpack[RequestOptions]
    ) -> AsyncIterator[Chunk]:
        """Answers a conversation, yielding the reply as it is generated (see `stream`).

        Options (`RequestOptions`): max_tokens, temperature (0 is greedy), top_p, top_k, min_p,
        repetition_penalty, seed, stop, logprobs, speculate; model; timeout (seconds for the whole call);
        retries (made again while no token has arrived; the client's by default).
        """
        request, limits = wire.request_of(messages, options, chat=True, retries=self.retries)
        return self._chunks(self._stub.Chat, request, limits)

    async def models(self, *, timeout: float = INFO_TIMEOUT) -> list[ModelInfo]:
        """The models the coordinator serves (retried on UNAVAILABLE, as `retries=` says)."""
        response = await self._unary(self._stub.ListModels, coordinator_pb2.ListModelsRequest(), timeout)
        return wire.models_from(response)

    async def cluster(self, *, timeout: float = INFO_TIMEOUT) -> ClusterStatus:
        """The coordinator's view of its workers, chains and requests (retried as `models` is)."""
        response = await self._unary(self._stub.ClusterStatus, coordinator_pb2.ClusterStatusRequest(), timeout)
        return wire.cluster_from(response)

    async def health(self, service: str = "", *, timeout: float = INFO_TIMEOUT) -> str:
        """The standard gRPC health check: "SERVING", "NOT_SERVING", ... ("" is the whole server).
        Never retried: an UNAVAILABLE here is the answer."""
        return await self._unary(self._health_check, service, timeout, retries=0)

    async def close(self) -> None:
        """Closes the channel; calls still running fail with CANCELLED."""
        await self._channel.close(grace=None)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def _chunks(self, method: _StreamMethod, request: wire.Request, limits: Limits) -> AsyncIterator[Chunk]:
        """The stream's chunks; built eagerly so that the caller's trace context is the one sent.
        The call is made again while `Attempts` says so, never once a chunk has arrived."""
        metadata = call_metadata() + self._auth
        with_logprobs = request.sampling.HasField("logprobs")

        async def chunks() -> AsyncIterator[Chunk]:
            attempts = Attempts(limits, GENERATE_CODES)
            while True:
                call = method(request, timeout=attempts.start(), metadata=metadata)
                answered = False  # once a chunk has arrived, an error ends the call
                try:
                    async for response in call:
                        answered = True
                        yield wire.chunk_from(response, with_logprobs=with_logprobs)
                    return
                except grpc.RpcError as err:  # grpc.aio.AioRpcError
                    error = error_from_rpc(err)
                    wait = attempts.wait_before_retry(error, answered=answered)
                    if wait is None:
                        raise error from err
                finally:
                    call.cancel()  # a no-op after the end; stops the server when the caller stops early
                await asyncio.sleep(wait)

        return chunks()

    async def _unary(
        self,
        method: Callable[..., Awaitable[_Response]],
        request: object,
        timeout: float,
        *,
        retries: int | None = None,
    ) -> _Response:
        """One answer; made again on UNAVAILABLE, `retries` times (the client's when None)."""
        limits = Limits(wire.check_timeout(timeout), self.retries if retries is None else retries)
        attempts, metadata = Attempts(limits, INFO_CODES), call_metadata() + self._auth
        while True:
            try:
                return await method(request, timeout=attempts.start(), metadata=metadata)
            except grpc.RpcError as err:
                error = error_from_rpc(err)
                wait = attempts.wait_before_retry(error)
                if wait is None:
                    raise error from err
            await asyncio.sleep(wait)
