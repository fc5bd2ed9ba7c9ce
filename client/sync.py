"""The blocking client: `Client`, one gRPC channel to a coordinator.

Owns the channel, each call's deadline and trace metadata, and turning gRPC failures (also those
in the middle of a stream) into the typed errors of `layerline.client.errors`. Knows nothing of
tokens beyond the ids the coordinator returns, nor of the messages' fields or the options'
limits: `wire` checks the options, builds the requests and reads the answers.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, TypeVar

import grpc

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


class _ResponseStream(Protocol):
    """A server-streaming call in flight (grpc's rendezvous object)."""

    def __iter__(self) -> Iterator[coordinator_pb2.GenerateResponse]: ...

    def cancel(self) -> bool: ...


_StreamMethod = Callable[..., _ResponseStream]


class Client:
    """A coordinator at `target` ("host:port").

    `token`: the bearer token sent with every call, when the coordinator requires one.
    `ca_cert`: a PEM file of the CA that signed the coordinator's certificate; the channel is then
    TLS (`credentials`, gRPC channel credentials, is the same for other setups). Neither: plaintext.
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
            self._channel = grpc.insecure_channel(target, options=channel_options())
        else:
            self._channel = grpc.secure_channel(target, credentials, options=channel_options())
        self._stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)  # type: ignore[no-untyped-call]
        self._health_check: grpc.UnaryUnaryMultiCallable[str, str] = self._channel.unary_unary(
            wire.HEALTH_CHECK_METHOD,
            request_serializer=wire.encode_health_request,
            response_deserializer=wire.decode_health_response,
        )

    def generate(self, prompt: str, **options: Unpack[RequestOptions]) -> Completion:
        """Completes `prompt` and returns the whole answer.

        Options (`RequestOptions`): max_tokens, temperature (0 is greedy), top_p, top_k, min_p,
        repetition_penalty, seed, stop, logprobs; model; timeout (seconds for the whole call).
        """
        return wire.completion_from(list(self.stream(prompt, **options)))

    def stream(self, prompt: str, **options: Unpack[RequestOptions]) -> Iterator[Chunk]:
        """Completes `prompt`, yielding the answer as it is generated; the last chunk has
        finish_reason and usage. Arguments are checked now; the call starts at the first `next`.

        Options (`RequestOptions`): max_tokens, temperature (0 is greedy), top_p, top_k, min_p,
        repetition_penalty, seed, stop, logprobs; model; timeout (seconds for the whole call).
        """
        request, timeout = wire.request_of(prompt, options, chat=False)
        return self._chunks(self._stub.Generate, request, timeout)

    def chat(self, messages: Sequence[Mapping[str, str]], **options: Unpack[RequestOptions]) -> Completion:
        """Answers a conversation (`[{"role": "user", "content": "Hi"}, ...]`) in one piece.

        Options (`RequestOptions`): max_tokens, temperature (0 is greedy), top_p, top_k, min_p,
        repetition_penalty, seed, stop, logprobs; model; timeout (seconds for the whole call).
        """
        return wire.completion_from(list(self.chat_stream(messages, **options)))

    def chat_stream(self, messages: Sequence[Mapping[str, str]], **options: Unpack[RequestOptions]) -> Iterator[Chunk]:
        """Answers a conversation, yielding the reply as it is generated (see `stream`).

        Options (`RequestOptions`): max_tokens, temperature (0 is greedy), top_p, top_k, min_p,
        repetition_penalty, seed, stop, logprobs; model; timeout (seconds for the whole call).
        """
        request, timeout = wire.request_of(messages, options, chat=True)
        return self._chunks(self._stub.Chat, request, timeout)

    def models(self, *, timeout: float = INFO_TIMEOUT) -> list[ModelInfo]:
        """The models the coordinator serves."""
        response = self._unary(self._stub.ListModels, coordinator_pb2.ListModelsRequest(), timeout)
        return wire.models_from(response)

    def cluster(self, *, timeout: float = INFO_TIMEOUT) -> ClusterStatus:
        """The coordinator's view of its workers, chains and requests."""
        response = self._unary(self._stub.ClusterStatus, coordinator_pb2.ClusterStatusRequest(), timeout)
        return wire.cluster_from(response)

    def health(self, service: str = "", *, timeout: float = INFO_TIMEOUT) -> str:
        """The standard gRPC health check: "SERVING", "NOT_SERVING", ... ("" is the whole server)."""
        return self._unary(self._health_check, service, timeout)

    def close(self) -> None:
        """Closes the channel; calls still running fail with CANCELLED."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _chunks(self, method: _StreamMethod, request: wire.Request, timeout: float) -> Iterator[Chunk]:
        """The stream's chunks; built eagerly so that the caller's trace context is the one sent."""
        metadata = call_metadata() + self._auth
        with_logprobs = request.sampling.HasField("logprobs")

        def chunks() -> Iterator[Chunk]:
            call = method(request, timeout=timeout, metadata=metadata)
            try:
                for response in call:
                    yield wire.chunk_from(response, with_logprobs=with_logprobs)
            except grpc.RpcError as err:
                raise error_from_rpc(err) from err
            finally:
                call.cancel()  # a no-op after the end; stops the server when the caller stops early

        return chunks()

    def _unary(self, method: Callable[..., _Response], request: object, timeout: float) -> _Response:
        deadline, metadata = wire.check_timeout(timeout), call_metadata() + self._auth
        try:
            return method(request, timeout=deadline, metadata=metadata)
        except grpc.RpcError as err:
            raise error_from_rpc(err) from err
