"""The layerline client SDK: talk to a coordinator over gRPC, text in, text out.

    from layerline.client import Client, AsyncClient
    with Client("127.0.0.1:7070") as c:
        print(c.generate("Once upon a time", max_tokens=32, temperature=0.0).text)

The keyword options of `generate`, `stream`, `chat` and `chat_stream` are `RequestOptions`. A
call refused with UNAVAILABLE or RESOURCE_EXHAUSTED before its first token is made again, at
most `retries` times (`Client(..., retries=3)`, the default; `layerline.client.retry` says how).

Owns nothing but the caller's requests and their streams. Needs only grpcio and protobuf (and
sends the caller's trace context when OpenTelemetry is installed); it never imports torch or
numpy, and knows nothing of tokenizers, weights or workers beyond what the coordinator reports.
"""

from .aio import AsyncClient
from .errors import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    LayerlineError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from .sync import Client
from .types import (
    ChainStatus,
    Chunk,
    ClusterStatus,
    Completion,
    ModelInfo,
    RequestOptions,
    TokenLogprobs,
    Usage,
    WorkerLoad,
    WorkerStatus,
)

__all__ = [
    "AsyncClient",
    "ChainStatus",
    "Chunk",
    "Client",
    "ClusterStatus",
    "Completion",
    "DeadlineExceeded",
    "Internal",
    "InvalidArgument",
    "LayerlineError",
    "ModelInfo",
    "NotFound",
    "PermissionDenied",
    "RequestOptions",
    "ResourceExhausted",
    "TokenLogprobs",
    "Unauthenticated",
    "Unavailable",
    "Usage",
    "WorkerLoad",
    "WorkerStatus",
]
