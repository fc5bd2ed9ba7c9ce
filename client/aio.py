"""The asyncio client: `AsyncClient`, the mirror of `Client` on a grpc.aio channel.

Owns the asyncio channel, each call's deadline and trace metadata, and turning gRPC failures
(also those in the middle of a stream) into the typed errors of `layerline.client.errors`.
Knows nothing of the messages' fields or the options' limits: `wire` checks the options, builds
the requests and reads the answers. Create it inside the event loop that uses it.
"""

from __future__ import annotations

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
from .tracing import call_metadata
from .types import Chunk, ClusterStatus, Completion, ModelInfo, RequestOptions
from .wire import INFO_TIMEOUT

if TYPE_CHECKING:  # typing_extensions is not a runtime dependency
    from typing_extensions import Unpack

_Response = TypeVar("_Response")
_StreamMethod = Callable[..., grpc.aio.UnaryStreamCall[wire.Request, coordinator_pb2.GenerateResponse]]


class AsyncClient:
    """A coordinator at `target` ("host:port"); `token`, `ca_cert` and `credentials` as for `Client`.

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
    ) -> None:
        self.target = target
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
        repetition_penalty, seed, stop, logprobs; model; timeout (seconds for the whole call).
        """
        return wire.completion_from([chunk async for chunk in self.stream(prompt, **options)])

    def stream(self, prompt: str, **options: Unpack[RequestOptions]) -> AsyncIterator[Chunk]:
        """Completes `prompt`, yielding the answer as it is generated; the last chunk has
        finish_reason and usage. Arguments are checked now; the call starts at the first step.

        Options (`RequestOptions`): max_tokens, temperature (0 is greedy), top_p, top_k, min_p,
        repetition_penalty, seed, stop, logprobs; model; timeout (seconds for the whole call).
        """
        request, timeout = wire.request_of(prompt, options, chat=False)
        return self._chunks(self._stub.Generate, request, timeout)

    async def chat(self, messages: Sequence[Mapping[str, str]], **options: Unpack[RequestOptions]) -> Completion:
        """Answers a conversation (`[{"role": "user", "content": "Hi"}, ...]`) in one piece.

        Options (`RequestOptions`): max_tokens, temperature (0 is greedy), top_p, top_k, min_p,
        repetition_penalty, seed, stop, logprobs; model; timeout (seconds for the whole call).
        """
        return wire.completion_from([chunk async for chunk in self.chat_stream(messages, **options)])

    def chat_stream(
        self, messages: Sequence[Mapping[str, str]], **options: Unpack[RequestOptions]
    ) -> AsyncIterator[Chunk]:
        """Answers a conversation, yielding the reply as it is generated (see `stream`).

        Options (`RequestOptions`): max_tokens, temperature (0 is greedy), top_p, top_k, min_p,
        repetition_penalty, seed, stop, logprobs; model; timeout (seconds for the whole call).
        """
        request, timeout = wire.request_of(messages, options, chat=True)
        return self._chunks(self._stub.Chat, request, timeout)

    async def models(self, *, timeout: float = INFO_TIMEOUT) -> list[ModelInfo]:
        """The models the coordinator serves."""
        response = await self._unary(self._stub.ListModels, coordinator_pb2.ListModelsRequest(), timeout)
        return wire.models_from(response)

    async def cluster(self, *, timeout: float = INFO_TIMEOUT) -> ClusterStatus:
        """The coordinator's view of its workers, chains and requests."""
        response = await self._unary(self._stub.ClusterStatus, coordinator_pb2.ClusterStatusRequest(), timeout)
        return wire.cluster_from(response)

    async def health(self, service: str = "", *, timeout: float = INFO_TIMEOUT) -> str:
        """The standard gRPC health check: "SERVING", "NOT_SERVING", ... ("" is the whole server)."""
        return await self._unary(self._health_check, service, timeout)

    async def close(self) -> None:
        """Closes the channel; calls still running fail with CANCELLED."""
        await self._channel.close(grace=None)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def _chunks(self, method: _StreamMethod, request: wire.Request, timeout: float) -> AsyncIterator[Chunk]:
        """The stream's chunks; built eagerly so that the caller's trace context is the one sent."""
        metadata = call_metadata() + self._auth
        with_logprobs = request.sampling.HasField("logprobs")

        async def chunks() -> AsyncIterator[Chunk]:
            call = method(request, timeout=timeout, metadata=metadata)
            try:
                async for response in call:
                    yield wire.chunk_from(response, with_logprobs=with_logprobs)
            except grpc.RpcError as err:  # grpc.aio.AioRpcError
                raise error_from_rpc(err) from err
            finally:
                call.cancel()  # a no-op after the end; stops the server when the caller stops early

        return chunks()

    async def _unary(self, method: Callable[..., Awaitable[_Response]], request: object, timeout: float) -> _Response:
        deadline, metadata = wire.check_timeout(timeout), call_metadata() + self._auth
        try:
            return await method(request, timeout=deadline, metadata=metadata)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from err
