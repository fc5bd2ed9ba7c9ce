"""Who may call the coordinator: bearer tokens on the client API, certificates' roles on the Registry.

Owns reading the tokens (`--api-tokens FILE`, `LAYERLINE_API_TOKENS`, `--admin-tokens FILE`),
comparing a call's `authorization: Bearer ...` with them in constant time, and the interceptor
that refuses a call before its handler runs: UNAUTHENTICATED without a valid token,
PERMISSION_DENIED for ClusterStatus without an admin token. The health service stays open. With
no token configured at all, the client API is open (a trusted network, or a proxy in front).
Knows nothing of requests beyond their method name and metadata.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

TOKENS_VARIABLE = "LAYERLINE_API_TOKENS"  # tokens, separated by commas or whitespace
OPEN_METHODS = ("/grpc.health.v1.Health/",)  # health stays open
ADMIN_METHODS = ("/layerline.v1.Coordinator/ClusterStatus",)
MAX_TOKENS = 4096  # tokens per file, a bound on the constant-time comparison


@dataclass(frozen=True)
class Tokens:
    """The digests of the tokens that may call the client API, and of those that may administer it."""

    users: frozenset[bytes]
    admins: frozenset[bytes]

    @property
    def required(self) -> bool:
        return bool(self.users or self.admins)

    @classmethod
    def load(cls, api_file: str | None, admin_file: str | None, environ: Mapping[str, str] = os.environ) -> Tokens:
        """Tokens from the files and the environment; ValueError naming a file that cannot be used."""
        from_environment = set(environ.get(TOKENS_VARIABLE, "").replace(",", " ").split())
        users = _read(api_file, "--api-tokens") | from_environment
        admins = _read(admin_file, "--admin-tokens")
        return cls(frozenset(map(_digest, users | admins)), frozenset(map(_digest, admins)))

    def role_of(self, token: str | None) -> str | None:
        """'admin', 'user' or None; every known token is compared, so the time does not say which matched."""
        if token is None:
            return None
        digest = _digest(token)
        user = admin = False
        for known in self.users:
            user |= hmac.compare_digest(digest, known)
        for known in self.admins:
            admin |= hmac.compare_digest(digest, known)
        return "admin" if admin else "user" if user else None


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()  # equal lengths: compare_digest leaks nothing


def _read(path: str | None, flag: str) -> set[str]:
    if path is None:
        return set()
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise ValueError(f"{flag} {path}: {err.strerror}") from None
    tokens = {line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")}
    if not tokens:
        raise ValueError(f"{flag} {path} holds no token (one per line; # starts a comment)")
    if len(tokens) > MAX_TOKENS:
        raise ValueError(f"{flag} {path} holds {len(tokens)} tokens, more than {MAX_TOKENS}")
    return tokens


def bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an `authorization: Bearer TOKEN` entry, if any (the scheme in any case, RFC 7235)."""
    for key, value in metadata or ():
        if key.lower() == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses client API calls without a valid token, and ClusterStatus without an admin token."""

    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens

    async def intercept_service(
        self, continuation: Continuation, details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(OPEN_METHODS) or not self.tokens.required:
            return handler
        role = self.tokens.role_of(bearer(details.invocation_metadata))
        if role is None:
            return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, "a valid bearer token is required")
        if role != "admin" and method.startswith(ADMIN_METHODS):
            return _refusing(handler, grpc.StatusCode.PERMISSION_DENIED, f"{method} needs an admin token")
        return handler


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends every call with `code`."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, details)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, details)
        yield  # an async generator, as a streaming handler is

    replace = {
        "unary_unary": unary,
        "stream_unary": unary,
        "unary_stream": streaming,
        "stream_stream": streaming,
    }
    kind = next(name for name in replace if getattr(handler, name) is not None)
    return handler._replace(**{kind: replace[kind]})  # type: ignore[attr-defined]  # grpc's handlers are namedtuples
