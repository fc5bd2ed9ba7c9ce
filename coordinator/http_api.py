"""The coordinator's OpenAI-compatible HTTP API: Starlette on uvicorn, in the coordinator's event loop.

Owns the routes (`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`,
`GET /health`, and `GET /metrics` when metrics are on), the bearer-token check (the same tokens
as the gRPC API; `/health` and `/metrics` stay open, as the gRPC health service and the metrics
port do), reading a body within a size limit, the server-sent events of a stream (`data: {json}`
per chunk, then `data: [DONE]`), and the HTTP status of each refusal: 400 for a bad parameter
(the same checks and messages as gRPC), 401 without a valid token, 404 for an unknown model, 429
with `Retry-After` when admission refuses, 503 when no chain serves. A client that disconnects
cancels its request, which frees its KV on every stage, as a cancelled gRPC stream does.

Every request goes through `Serving`, the one generation path the gRPC servicer takes too.
Knows nothing of gRPC messages or torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import socket
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from layerline.shared.errors import Code, InvalidInput, NoCapacity, Unreachable, status_of

from .auth import Tokens, bearer
from .generation import Delta, Finished
from .openai_api import Answer, Asked, asked, error_body, messages_of, prompt_of
from .requests import check_chat, check_prompt
from .serving import GenerationFailed, Request, Serving, UnknownModel

log = logging.getLogger(__name__)
T = TypeVar("T")

HTTP_STATUS = {
    Code.INVALID_ARGUMENT: 400,
    Code.UNAUTHENTICATED: 401,
    Code.PERMISSION_DENIED: 403,
    Code.NOT_FOUND: 404,
    Code.RESOURCE_EXHAUSTED: 429,
    Code.UNAVAILABLE: 503,
    Code.DEADLINE_EXCEEDED: 504,
}


def _error(status: int, message: str, *, retry_after_ms: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(max(1, math.ceil(retry_after_ms / 1000)))} if retry_after_ms is not None else None
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


async def _not_found(request: HttpRequest, exc: Exception) -> JSONResponse:
    return _error(404, f"no such path: {request.url.path}")


async def _not_allowed(request: HttpRequest, exc: Exception) -> JSONResponse:
    return _error(405, f"{request.method} is not allowed on {request.url.path}")


async def _internal(request: HttpRequest, exc: Exception) -> JSONResponse:
    log.error("HTTP %s %s failed", request.method, request.url.path, exc_info=exc)
    return _error(500, "internal error (the coordinator's log has the details)")


def _refusal(err: Exception) -> JSONResponse:
    """The response for a typed refusal of `Serving`, or a generation that failed before any chunk."""
    if isinstance(err, UnknownModel):
        return _error(404, str(err))
    if isinstance(err, GenerationFailed):
        return _error(HTTP_STATUS.get(err.code, 500), err.message)
    return _error(HTTP_STATUS.get(status_of(err), 500), str(err), retry_after_ms=getattr(err, "retry_after_ms", None))


REFUSALS = (InvalidInput, NoCapacity, Unreachable, GenerationFailed)


class HttpApi:
    def __init__(
        self,
        serving: Serving,
        *,
        tokens: Tokens,
        max_body_bytes: int,
        metrics: Callable[[], bytes] | None = None,
    ) -> None:
        self.serving = serving
        self.tokens = tokens
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics  # the Prometheus text of the coordinator's metrics; None: metrics are off
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        if metrics is not None:
            routes.append(Route("/metrics", self.prometheus, methods=["GET"]))
        handlers = {404: _not_found, 405: _not_allowed, 500: _internal}
        self.app = Starlette(routes=routes, exception_handlers=handlers)

    def _unauthorized(self, request: HttpRequest) -> JSONResponse | None:
        if not self.tokens.required:
            return None
        if self.tokens.role_of(bearer(request.headers.items())) is None:
            return _error(401, "a valid bearer token is required (Authorization: Bearer TOKEN)")
        return None

    async def _body(self, request: HttpRequest) -> dict[str, Any]:
        """The JSON object of the body; BodyTooLarge past the size limit, InvalidInput for anything
        but a JSON object."""
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BodyTooLarge(f"the request body is over {self.max_body_bytes} bytes")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, RecursionError) as err:
            raise InvalidInput(f"the request body is not JSON: {err}") from None
        if not isinstance(body, dict):
            raise InvalidInput("the request body must be a JSON object")
        return body

    async def completions(self, request: HttpRequest) -> Response:
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: HttpRequest) -> Response:
        return await self._complete(request, chat=True)

    async def _complete(self, request: HttpRequest, *, chat: bool) -> Response:
        if (refused := self._unauthorized(request)) is not None:
            return refused
        serving = self.serving
        try:
            body = await self._body(request)
        except ClientDisconnect:
            return Response(status_code=499)  # nobody reads it
        except BodyTooLarge as err:
            return _error(413, str(err))
        except InvalidInput as err:
            return _error(400, str(err))
        try:
            options = asked(body, chat=chat)
            if chat:
                conversation = check_chat(messages_of(body), serving.admission)
                operation, encode = "chat", functools.partial(serving.encoder.chat, conversation)
            else:
                prompt = prompt_of(body)
                check_prompt(prompt, serving.admission)
                operation, encode = "text_completion", functools.partial(serving.encoder.prompt, prompt)
        except InvalidInput as err:
            return _error(400, str(err))
        ask = Request(
            operation,
            encode,
            options.sampling,
            max_tokens=options.max_tokens,
            speculate=options.speculate,
            stop=options.stop,
            model=options.model,
            metadata=list(request.headers.items()),
        )
        answer = Answer(
            chat=chat,
            model=options.model or serving.model_name,
            request_id=f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            token_text=lambda token_id: serving.text.decode([token_id]),
        )
        events = serving.generate(ask)
        if not options.stream:

            async def whole() -> None:
                async with contextlib.aclosing(events):
                    async for event in events:
                        answer.take(event, logprobs=options.logprobs)

            try:
                await _unless_disconnected(request, whole())
            except REFUSALS as err:
                return _refusal(err)
            except ClientDisconnect:
                return Response(status_code=499)
            return JSONResponse(answer.whole(logprobs=options.logprobs))
        try:  # a refusal still gets its status: the stream starts with the first event
            first = await _unless_disconnected(request, events.__anext__())
        except (*REFUSALS, ClientDisconnect) as err:
            await events.aclose()
            return _refusal(err) if not isinstance(err, ClientDisconnect) else Response(status_code=499)
        return _ClosingStream(
            _sse(answer, first, events, options),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def models(self, request: HttpRequest) -> Response:
        if (refused := self._unauthorized(request)) is not None:
            return refused
        model = {
            "id": self.serving.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "layerline",
            "max_model_len": self.serving.admission.max_context,
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, request: HttpRequest) -> Response:
        """200 while a complete chain serves, 503 otherwise."""
        cluster = self.serving.cluster
        cluster.refresh()
        if cluster.chains:
            return JSONResponse({"status": "ok", "chains": len(cluster.chains)})
        return JSONResponse(error_body(503, "no complete chain of workers serves right now"), status_code=503)

    async def prometheus(self, request: HttpRequest) -> Response:
        assert self.metrics is not None
        return Response(self.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def _sse(
    answer: Answer, first: Delta | Finished, events: AsyncGenerator[Delta | Finished, None], options: Asked
) -> AsyncIterator[str]:
    """The stream's server-sent events; a failure after the first chunk ends it with an error event.
    Leaving it early (the client went away) closes `events`, which cancels the request."""
    try:
        async for event in _after(first, events):
            yield _data(answer.chunk(event, logprobs=options.logprobs))
            if isinstance(event, Finished):
                answer.take(event, logprobs=False)
        if options.include_usage and answer.finished is not None:
            yield _data(answer.usage_chunk())
        yield "data: [DONE]\n\n"
    except REFUSALS as err:
        body = error_body(_refusal(err).status_code, getattr(err, "message", str(err)))
        yield _data(body)
    finally:
        await events.aclose()


async def _after(first: Delta | Finished, events: AsyncIterator[Delta | Finished]) -> AsyncIterator[Delta | Finished]:
    """`first`, then the rest of `events`."""
    yield first
    async for event in events:
        yield event


class BodyTooLarge(InvalidInput):
    """The request body is over the API's limit."""


async def _unless_disconnected(request: HttpRequest, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientDisconnect once the client has gone (`work` is then cancelled,
    which ends its request and frees its KV), as vLLM's `with_cancellation` does."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, *REFUSALS):
            await task
        raise ClientDisconnect
    return task.result()


class _ClosingStream(StreamingResponse):
    """A stream whose events are closed however the response ends, so the request is cancelled
    at once when the client goes, not when the garbage collector finds the generator."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


def _data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _Uvicorn(uvicorn.Server):
    """uvicorn inside a process that owns its signals: it never installs handlers of its own."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """`api` served on `host:port` in this event loop (HTTPS when given a certificate and key)."""

    def __init__(
        self,
        api: HttpApi,
        host: str,
        port: int,
        *,
        grace: float = 30.0,
        certfile: str | None = None,
        keyfile: str | None = None,
    ) -> None:
        self.sock = _bound(host, port)
        self.port = self.sock.getsockname()[1]
        self.tls = certfile is not None
        config = uvicorn.Config(
            api.app,
            lifespan="off",
            log_level="warning",
            access_log=False,
            ssl_certfile=certfile,
            ssl_keyfile=keyfile,
            timeout_graceful_shutdown=math.ceil(grace),  # seconds requests in progress get at a stop
        )
        self._server = _Uvicorn(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self.sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # its error, if it failed to start
                raise OSError(f"the HTTP API did not start on port {self.port}")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stop taking requests; those in progress get a few seconds (their streams are cancelled after)."""
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        self.sock.close()


def _bound(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port`, or OSError naming it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise OSError(
            f"cannot listen on {host}:{port}: the port is in use, or the host is not an address of this machine"
        ) from None
    return sock
