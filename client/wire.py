"""The client SDK's side of the wire: requests built and checked, responses turned into dataclasses.

Owns the only use of the generated protobuf classes in the SDK: `request_of`, the one place
that checks a call's `RequestOptions` and builds its `GenerateRequest` / `ChatRequest` (a
sampling option left as None is not sent, so the server's default applies) and its limits
(deadline and retries), and the conversion of every response into the plain dataclasses of
`layerline.client.types`. Also owns the two tiny messages of the standard gRPC health check, so
that the SDK needs no `grpcio-health-checking`, and the check of every call's deadline and
retries. Knows nothing of channels or threads: `sync` and `aio` make the calls.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, TypeAlias

import grpc
from google.protobuf import wrappers_pb2

from layerline.protos.v1 import common_pb2, coordinator_pb2, tensor_pb2

from .errors import Internal
from .retry import Limits
from .types import (
    ChainStatus,
    Chunk,
    ClusterStatus,
    Completion,
    FinishReason,
    ModelInfo,
    RequestOptions,
    TokenLogprobs,
    Usage,
    WorkerLoad,
    WorkerStatus,
)

GENERATE_TIMEOUT = 600.0  # seconds: the default deadline of one whole generation
INFO_TIMEOUT = 30.0  # seconds: the default deadline of models(), cluster() and health()
HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"
_UINT32_MAX = 2**32 - 1
_UINT64_MAX = 2**64 - 1
_FINISH: dict[int, FinishReason] = {
    coordinator_pb2.FINISH_REASON_STOP: "stop",
    coordinator_pb2.FINISH_REASON_LENGTH: "length",
}
_SERVING_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
OPTIONS = tuple(RequestOptions.__annotations__)  # the keywords a generating call takes, in order

Request: TypeAlias = coordinator_pb2.GenerateRequest | coordinator_pb2.ChatRequest


class _Enum(Protocol):
    """A generated protobuf enum type."""

    def Name(self, number: int) -> str: ...


def request_of(query: object, options: RequestOptions, *, chat: bool, retries: int) -> tuple[Request, Limits]:
    """The request a generating call sends and its limits, every argument checked.

    `query` is a prompt (a GenerateRequest), or with `chat` a conversation (a ChatRequest);
    `retries` is the client's, for a call whose options do not say. An option that is not one of
    `OPTIONS` raises TypeError, a bad value ValueError naming it.
    """
    unknown = [name for name in options if name not in OPTIONS]
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}; the options are {', '.join(OPTIONS)}")
    sampling = common_pb2.SamplingParams(
        max_tokens=_integer("max_tokens", options.get("max_tokens"), low=1, high=_UINT32_MAX),
        temperature=_number("temperature", options.get("temperature"), low=0.0),
        top_p=_number("top_p", options.get("top_p"), low=0.0, low_open=True, high=1.0),
        top_k=_integer("top_k", options.get("top_k"), low=0, high=_UINT32_MAX),
        min_p=_number("min_p", options.get("min_p"), low=0.0, high=1.0),
        repetition_penalty=_number("repetition_penalty", options.get("repetition_penalty"), low=0.0, low_open=True),
        seed=_integer("seed", options.get("seed"), low=0, high=_UINT64_MAX),
        logprobs=_integer("logprobs", options.get("logprobs"), low=0, high=_UINT32_MAX),
        speculate=_integer("speculate", options.get("speculate"), low=0, high=_UINT32_MAX),
        stop=_stop_strings(options.get("stop")),
    )
    model = _model(options.get("model"))
    request = _chat_request(query, model, sampling) if chat else _generate_request(query, model, sampling)
    timeout = check_timeout(options.get("timeout", GENERATE_TIMEOUT))
    return request, Limits(timeout, check_retries(options.get("retries", retries)))


def check_timeout(timeout: object) -> float:
    """A call's deadline in seconds from now: a finite number > 0."""
    seconds = _number("timeout", timeout, low=0.0, low_open=True)
    if seconds is None:
        raise ValueError("timeout must be a number, got None")
    return seconds


def check_retries(retries: object) -> int:
    """How many times a call may be made again: an int >= 0 (0: never)."""
    count = _integer("retries", retries, low=0, high=_UINT32_MAX)
    if count is None:
        raise ValueError("retries must be an int, got None")
    return count


def chunk_from(response: coordinator_pb2.GenerateResponse, *, with_logprobs: bool) -> Chunk:
    logprobs = [
        TokenLogprobs(logprob=lp.logprob, top=[(top.token_id, top.logprob) for top in lp.top_logprobs])
        for lp in response.logprobs
    ]
    usage = response.usage if response.HasField("usage") else None
    return Chunk(
        text=response.text,
        token_ids=list(response.token_ids),
        finish_reason=_FINISH.get(response.finish_reason),
        usage=Usage(usage.prompt_tokens, usage.completion_tokens) if usage is not None else None,
        logprobs=logprobs if with_logprobs else None,
    )


def completion_from(chunks: Sequence[Chunk]) -> Completion:
    """The whole answer of a finished stream; its last chunk must say why it finished."""
    last = chunks[-1] if chunks else None
    if last is None or last.finish_reason is None or last.usage is None:
        raise Internal(grpc.StatusCode.INTERNAL, "the answer stream ended without a finish_reason and usage")
    with_logprobs = last.logprobs is not None
    return Completion(
        text="".join(chunk.text for chunk in chunks),
        token_ids=[token for chunk in chunks for token in chunk.token_ids],
        finish_reason=last.finish_reason,
        usage=last.usage,
        logprobs=[lp for chunk in chunks for lp in chunk.logprobs or ()] if with_logprobs else None,
    )


def models_from(response: coordinator_pb2.ListModelsResponse) -> list[ModelInfo]:
    return [ModelInfo(m.model_id, m.model_name, m.num_layers, m.ready_replicas) for m in response.models]


def cluster_from(response: coordinator_pb2.ClusterStatusResponse) -> ClusterStatus:
    workers = []
    for entry in response.workers:
        w = entry.worker
        workers.append(
            WorkerStatus(
                address=w.address,
                host=w.host,
                pid=w.pid,
                instance_id=w.instance_id,
                model_id=w.model_id,
                model_name=w.model_name,
                layers=(w.layer_start, w.layer_end),
                num_layers=w.num_layers,
                replica=entry.replica if entry.HasField("replica") else None,
                tp=w.tp_size,
                state=_enum_name(common_pb2.WorkerState, w.state).removeprefix("WORKER_STATE_"),
                dtype=_enum_name(tensor_pb2.DType, w.dtype).lower(),
                device=w.device,
                load=WorkerLoad(
                    w.in_flight_steps,
                    w.active_sequences,
                    w.kv_blocks_free,
                    w.kv_blocks_total,
                    entry.kv_blocks_cached,
                    w.steps_computed,
                    w.compute_seconds,
                    w.steps_run_ahead,
                    w.steps_run_ahead_dropped,
                ),
                seconds_since_heartbeat=entry.seconds_since_heartbeat,
                weights_bytes=w.weights_bytes,
            )
        )
    chains = [
        ChainStatus(
            c.replica, c.model_id, list(c.addresses), c.active_sequences, c.cached_prefixes, c.cached_prefix_tokens
        )
        for c in response.chains
    ]
    return ClusterStatus(
        workers,
        chains,
        response.active_requests,
        response.queued_requests,
        response.failovers,
        response.last_failover_gap_seconds,
        response.max_failover_gap_seconds,
        response.shared_prefix_tokens,
        response.preemptions,
        response.stalls,
        response.prefix_cache_queries,
        response.spec_decode_draft_tokens,
        response.spec_decode_accepted_tokens,
    )


# The health messages, HealthCheckRequest{string service = 1} and
# HealthCheckResponse{ServingStatus status = 1}, have the same wire format as the well-known
# StringValue{string value = 1} and Int32Value{int32 value = 1} (an enum is an int32 varint).
def encode_health_request(service: str) -> bytes:
    return wrappers_pb2.StringValue(value=service).SerializeToString()


def decode_health_response(data: bytes) -> str:
    """The serving status's name: "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN" or "UNKNOWN"."""
    status = wrappers_pb2.Int32Value.FromString(data).value
    return _SERVING_STATUS.get(status, f"UNKNOWN_STATUS_{status}")


def _generate_request(
    prompt: object, model: str, sampling: common_pb2.SamplingParams
) -> coordinator_pb2.GenerateRequest:
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a str, got {type(prompt).__name__}")
    return coordinator_pb2.GenerateRequest(model=model, prompt=prompt, sampling=sampling)


def _chat_request(messages: object, model: str, sampling: common_pb2.SamplingParams) -> coordinator_pb2.ChatRequest:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    wire_messages = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {message!r}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}]['role'] must be a non-empty str, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}]['content'] must be a str, got {type(content).__name__}")
        wire_messages.append(coordinator_pb2.ChatMessage(role=role, content=content))
    return coordinator_pb2.ChatRequest(model=model, messages=wire_messages, sampling=sampling)


def _integer(name: str, value: object, *, low: int, high: int) -> int | None:
    """`value` checked; None passes as None (not sent)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return value


def _number(
    name: str,
    value: object,
    *,
    low: float,
    low_open: bool = False,
    high: float | None = None,
) -> float | None:
    """`value` checked, as a float; None passes as None (not sent)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value}")
    if low_open and number <= low:
        raise ValueError(f"{name} must be > {low:g}, got {value}")
    if not low_open and number < low:
        raise ValueError(f"{name} must be >= {low:g}, got {value}")
    if high is not None and number > high:
        raise ValueError(f"{name} must be <= {high:g}, got {value}")
    return number


def _stop_strings(stop: object) -> list[str]:
    if stop is None:
        return []
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, Sequence) or isinstance(strings, bytes):
        raise ValueError(f"stop must be a str or a list of str, got {type(stop).__name__}")
    for s in strings:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must hold non-empty strs, got {s!r}")
    return list(strings)


def _model(model: object) -> str:
    if model is not None and not isinstance(model, str):
        raise ValueError(f"model must be a str or None, got {type(model).__name__}")
    return model or ""


def _enum_name(enum: _Enum, value: int) -> str:
    try:
        return enum.Name(value)
    except ValueError:  # a value newer than these generated classes
        return str(value)


def channel_credentials(
    ca_cert: str | os.PathLike[str] | None, credentials: grpc.ChannelCredentials | None
) -> grpc.ChannelCredentials | None:
    """TLS trusting the CA in the file `ca_cert`, or the `credentials` given, or None (plaintext)."""
    if ca_cert is None:
        return credentials
    if credentials is not None:
        raise ValueError("give ca_cert or credentials, not both")
    try:
        pem = Path(ca_cert).read_bytes()
    except OSError as err:
        raise ValueError(f"ca_cert {ca_cert}: {err.strerror}") from None
    if b"-----BEGIN CERTIFICATE-----" not in pem:
        raise ValueError(f"ca_cert {ca_cert}: not a PEM certificate")
    return grpc.ssl_channel_credentials(root_certificates=pem)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The `authorization: Bearer TOKEN` entry every call carries (none without a token)."""
    if token is None:
        return ()
    if not isinstance(token, str) or not token or not token.isprintable() or not token.isascii() or " " in token:
        raise ValueError("token must be a non-empty string of printable ASCII without spaces")
    return (("authorization", f"Bearer {token}"),)
