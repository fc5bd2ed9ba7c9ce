"""Serving a generated servicer on a `grpc.aio` server, with requests that do not decode refused.

Owns `add_servicer`: what the generated `add_XServicer_to_server` functions do (a method handler
per method of the service, registered both as a generic handler and on gRPC's registered-method
fast path), built from the service's descriptor so that one function serves every service, with
each request deserializer wrapped. Bytes that do not parse as the method's request message end
the call with INVALID_ARGUMENT naming the method, for a unary request and for every message of
a client stream, where gRPC alone answers UNKNOWN ("Unexpected DecodeError"). Requests that
parse are passed on untouched.

Imports grpc and protobuf, and nothing of any service.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message

__all__ = ["add_servicer"]

_Context = grpc.aio.ServicerContext[Any, Any]


@dataclass(frozen=True)
class _Undecodable:
    """What the deserializer hands on in place of a request that does not parse."""

    reason: str  # the words INVALID_ARGUMENT answers with


def add_servicer(server: grpc.aio.Server, servicer: object, service: ServiceDescriptor) -> None:
    """Serve `servicer`'s methods of `service` (e.g. `stage_pb2.DESCRIPTOR.services_by_name["StageWorker"]`)
    on `server`, in place of `add_XServicer_to_server(servicer, server)`.

    The servicer is a grpc.aio one: a method answering one message is a coroutine, one answering
    a stream an async generator (a method it leaves to the generated base class still answers
    UNIMPLEMENTED).
    """
    handlers = {method.name: _handler(method, getattr(servicer, method.name)) for method in service.methods}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    # The fast path the generated code takes too (grpcio >= 1.66); grpc-stubs does not know it yet.
    server.add_registered_method_handlers(service.full_name, handlers)  # type: ignore[attr-defined]


def _handler(method: MethodDescriptor, call: Callable[..., Any]) -> grpc.RpcMethodHandler[Any, Any]:
    name = f"/{method.containing_service.full_name}/{method.name}"
    parse = _parser(message_factory.GetMessageClass(method.input_type), name)
    serialize = message_factory.GetMessageClass(method.output_type).SerializeToString
    streams = method.client_streaming, method.server_streaming
    if streams == (False, False):
        return grpc.unary_unary_rpc_method_handler(
            _unary_unary(call), request_deserializer=parse, response_serializer=serialize
        )
    if streams == (False, True):
        return grpc.unary_stream_rpc_method_handler(
            _unary_stream(call), request_deserializer=parse, response_serializer=serialize
        )
    if streams == (True, False):
        return grpc.stream_unary_rpc_method_handler(
            _stream_unary(call), request_deserializer=parse, response_serializer=serialize
        )
    return grpc.stream_stream_rpc_method_handler(
        _stream_stream(call), request_deserializer=parse, response_serializer=serialize
    )


def _parser(cls: type[Message], name: str) -> Callable[[bytes], object]:
    """The request deserializer: the message, or an `_Undecodable` saying why not."""
    full_name = cls.DESCRIPTOR.full_name

    def parse(raw: bytes) -> object:
        try:
            return cls.FromString(raw)
        except DecodeError as err:  # wrong wire format, a bad UTF-8 string, nesting too deep
            return _Undecodable(f"{name}: a request message does not decode as {full_name} ({err})")

    return parse


async def _decoded(request: object, context: _Context) -> None:
    """Ends the call with INVALID_ARGUMENT when `request` did not decode."""
    if isinstance(request, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)


async def _each_decoded(requests: AsyncIterator[object], context: _Context) -> AsyncIterator[object]:
    """A client stream's messages, the call ended at the first that does not decode."""
    async for request in requests:
        await _decoded(request, context)
        yield request


# gRPC tells a handler's kind by inspection (a coroutine function answers once, or streams by
# writing to its context; an async generator function streams by yielding), so each wrapper
# below is of the kind of the method it stands for.


def _unary_unary(call: Callable[..., Any]) -> Callable[..., Any]:
    async def behavior(request: object, context: _Context) -> Any:
        await _decoded(request, context)
        return await call(request, context)

    return behavior


def _unary_stream(call: Callable[..., Any]) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(call):  # it writes its responses itself (health's Watch does)
        return _unary_unary(call)

    async def behavior(request: object, context: _Context) -> AsyncIterator[Any]:
        await _decoded(request, context)
        async for response in call(request, context):
            yield response

    return behavior


def _stream_unary(call: Callable[..., Any]) -> Callable[..., Any]:
    async def behavior(requests: AsyncIterator[object], context: _Context) -> Any:
        return await call(_each_decoded(requests, context), context)

    return behavior


def _stream_stream(call: Callable[..., Any]) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(call):  # it writes its responses itself
        return _stream_unary(call)

    async def behavior(requests: AsyncIterator[object], context: _Context) -> AsyncIterator[Any]:
        async for response in call(_each_decoded(requests, context), context):
            yield response

    return behavior


async def health_only_server(health: object, address: str) -> grpc.aio.Server:
    """A started plaintext server at `address` with only the standard health service `health`:
    what an orchestrator's probes ask (Kubernetes' gRPC probes speak no TLS). It answers what the
    process's own health service answers, and nothing else."""
    from grpc_health.v1 import health_pb2

    from .rpc import listen, server_options

    server = grpc.aio.server(options=server_options(64 << 10), maximum_concurrent_rpcs=16)
    add_servicer(server, health, health_pb2.DESCRIPTOR.services_by_name["Health"])
    listen(server, address)
    await server.start()
    return server
