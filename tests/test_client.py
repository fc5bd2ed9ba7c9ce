"""The client SDK against a scripted Coordinator (`scripted_coordinator`) served by a real gRPC
server on 127.0.0.1: the tests see exactly what went on the wire, and how many times."""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Coroutine, Iterator
from concurrent import futures
from contextlib import aclosing
from typing import Any, TypeVar

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider

from layerline.client import (
    AsyncClient,
    ChainStatus,
    Chunk,
    Client,
    ClusterStatus,
    Completion,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    LayerlineError,
    ModelInfo,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    TokenLogprobs,
    Unavailable,
    Usage,
    WorkerLoad,
    WorkerStatus,
    tracing,
    wire,
)
from layerline.protos.v1 import common_pb2, coordinator_pb2_grpc
from layerline.shared.rpc import channel_options, listen, server_options

from .scripted_coordinator import BUSY_DETAILS, NO_CHAIN_DETAILS, UNAVAILABLE_DETAILS, ScriptedCoordinator


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, ScriptedCoordinator]]:
    servicer = ScriptedCoordinator()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=channel_options())
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, grpc_server)
    health_servicer = health.HealthServicer()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("layerline.v1.Coordinator", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    yield f"127.0.0.1:{port}", servicer
    grpc_server.stop(grace=None)


@pytest.fixture
def coordinator(server: tuple[str, ScriptedCoordinator]) -> ScriptedCoordinator:
    server[1].received.clear()
    server[1].cancelled.clear()
    server[1].tries.clear()
    return server[1]


@pytest.fixture
def client(server: tuple[str, ScriptedCoordinator], coordinator: ScriptedCoordinator) -> Iterator[Client]:
    with Client(server[0]) as c:
        yield c


T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


MESSAGES = [{"role": "user", "content": "Hi"}]
STORY_COMPLETION = Completion(
    text="Once there was", token_ids=[101, 102, 103, 104], finish_reason="stop", usage=Usage(4, 4), logprobs=None
)
STORY_CHUNKS = [
    Chunk("Once", [101], None, None, None),
    Chunk(" there", [102, 103], None, None, None),
    Chunk(" was", [104], "stop", Usage(4, 4), None),
]


def test_generate_returns_the_whole_answer_and_sends_only_the_given_params(
    client: Client, coordinator: ScriptedCoordinator
) -> None:
    assert client.generate("Once upon a time", max_tokens=32, temperature=0.0) == STORY_COMPLETION
    [received] = coordinator.received
    assert received.method == "Generate"
    assert received.request.prompt == "Once upon a time" and received.request.model == ""
    sampling = received.request.sampling
    assert [f.name for f, _ in sampling.ListFields()] == ["max_tokens", "temperature"]
    assert sampling.max_tokens == 32 and sampling.HasField("temperature") and sampling.temperature == 0.0


def test_no_params_sends_an_empty_sampling_message(client: Client, coordinator: ScriptedCoordinator) -> None:
    client.generate("Once upon a time")
    assert coordinator.received[0].request.sampling.ListFields() == []


def test_every_param_and_the_model_reach_the_server(client: Client, coordinator: ScriptedCoordinator) -> None:
    client.generate(
        "Once upon a time",
        max_tokens=7,
        temperature=0.5,
        top_p=0.75,
        top_k=40,
        min_p=0.25,
        repetition_penalty=1.5,
        seed=2**64 - 1,
        stop=["\n\n", "END"],
        logprobs=2,
        speculate=4,
        model="smollm2",
    )
    client.generate("Once upon a time", stop="END", top_k=0)
    first, second = (r.request for r in coordinator.received)
    assert first.model == "smollm2"
    assert first.sampling == common_pb2.SamplingParams(
        max_tokens=7,
        temperature=0.5,
        top_p=0.75,
        top_k=40,
        min_p=0.25,
        repetition_penalty=1.5,
        seed=2**64 - 1,
        stop=["\n\n", "END"],
        logprobs=2,
        speculate=4,
    )
    assert list(second.sampling.stop) == ["END"]
    assert not second.sampling.HasField("speculate")  # the coordinator's --speculate
    assert second.sampling.HasField("top_k") and second.sampling.top_k == 0


def test_stream_yields_each_delta_and_the_final_chunk(client: Client) -> None:
    assert list(client.stream("Once upon a time", max_tokens=32)) == STORY_CHUNKS


def test_chat_sends_the_messages(client: Client, coordinator: ScriptedCoordinator) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert client.chat(messages, max_tokens=32) == STORY_COMPLETION
    assert list(client.chat_stream(messages, seed=3)) == STORY_CHUNKS
    first, second = coordinator.received
    assert first.method == second.method == "Chat"
    assert [(m.role, m.content) for m in first.request.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert first.request.sampling.max_tokens == 32 and second.request.sampling.seed == 3


def test_logprobs_are_returned_per_token(client: Client) -> None:
    expected = [TokenLogprobs(-0.5, [(7, -0.5)]), TokenLogprobs(-1.25, [(9, -1.0)])]
    assert client.generate("logprobs", logprobs=1) == Completion("Hi!", [7, 8], "length", Usage(3, 2), expected)
    chunks = list(client.stream("logprobs", logprobs=1))
    assert [c.logprobs for c in chunks] == [expected[:1], expected[1:]]


def test_an_error_in_the_middle_of_a_stream_is_raised_typed_and_never_retried(
    client: Client, coordinator: ScriptedCoordinator
) -> None:
    chunks = client.stream("fail midway")
    assert next(chunks) == STORY_CHUNKS[0]
    with pytest.raises(Unavailable) as caught:
        next(chunks)
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE and caught.value.details == UNAVAILABLE_DETAILS
    assert str(caught.value) == f"UNAVAILABLE: {UNAVAILABLE_DETAILS}"
    with pytest.raises(Unavailable) as whole:
        client.generate("fail midway")  # a token had arrived, though the caller saw none
    assert (caught.value.attempts, whole.value.attempts, coordinator.tries["fail midway"]) == (1, 1, 2)


def test_resource_exhausted_carries_the_retry_hint(client: Client) -> None:
    with pytest.raises(ResourceExhausted) as caught:
        client.generate("busy", retries=0)
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert caught.value.details == BUSY_DETAILS and caught.value.retry_after == 1.5
    assert isinstance(caught.value, LayerlineError) and caught.value.attempts == 1


def test_a_refused_call_is_made_again_after_the_retry_hint(
    client: Client, coordinator: ScriptedCoordinator, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="layerline.client")
    start = time.monotonic()
    assert client.generate("busy twice") == STORY_COMPLETION
    assert time.monotonic() - start >= 0.8  # the hint (400 ms) twice; backoff alone waits 0.3 to 0.6 s
    assert coordinator.tries["busy twice"] == 3
    assert caplog.messages == [
        f"RESOURCE_EXHAUSTED: {BUSY_DETAILS}; retry 1 of 3 in 0.40 s",
        f"RESOURCE_EXHAUSTED: {BUSY_DETAILS}; retry 2 of 3 in 0.40 s",
    ]


def test_unavailable_before_the_first_chunk_is_retried_unless_retries_is_0(
    server: tuple[str, ScriptedCoordinator], client: Client, coordinator: ScriptedCoordinator
) -> None:
    assert list(client.stream("unavailable once")) == STORY_CHUNKS
    assert coordinator.tries["unavailable once"] == 2
    coordinator.tries.clear()
    with pytest.raises(Unavailable) as per_call:
        client.generate("unavailable once", retries=0)
    coordinator.tries.clear()
    with Client(server[0], retries=0) as never, pytest.raises(Unavailable) as per_client:
        never.chat([{"role": "user", "content": "unavailable once"}])
    assert (per_call.value.attempts, per_client.value.attempts) == (1, 1)
    assert per_client.value.details == NO_CHAIN_DETAILS and coordinator.tries["unavailable once"] == 1


def test_retries_are_bounded_and_the_last_error_is_raised(
    server: tuple[str, ScriptedCoordinator], coordinator: ScriptedCoordinator
) -> None:
    with Client(server[0], retries=2) as c, pytest.raises(Unavailable) as caught:
        c.generate("down")
    assert caught.value.attempts == coordinator.tries["down"] == 3
    assert caught.value.details == NO_CHAIN_DETAILS


def test_no_retry_waits_past_the_call_deadline(client: Client, coordinator: ScriptedCoordinator) -> None:
    start = time.monotonic()
    with pytest.raises(ResourceExhausted) as busy:
        client.generate("busy", timeout=1.0)  # its hint, 1.5 s, ends past the deadline
    assert busy.value.attempts == 1 and time.monotonic() - start < 1.0
    start = time.monotonic()
    with pytest.raises(Unavailable) as down:
        client.generate("down", timeout=1.0, retries=100)
    assert 2 <= down.value.attempts == coordinator.tries["down"] <= 5  # waits of 0.1-0.2, 0.2-0.4, 0.4-0.8 s, ...
    assert time.monotonic() - start < 1.5


def test_grpc_retry_pushback_alone_is_the_retry_hint(client: Client) -> None:
    with pytest.raises(ResourceExhausted) as caught:
        client.generate("busy, pushback only", retries=0)
    assert caught.value.metadata == (("grpc-retry-pushback-ms", "250"),)
    assert caught.value.retry_after == 0.25


@pytest.mark.parametrize(
    ("metadata", "retry_after"),
    [
        ((("retry-after-ms", "1500"), ("grpc-retry-pushback-ms", "250")), 1.5),
        ((("grpc-retry-pushback-ms", "250"), ("retry-after-ms", "1500")), 1.5),
        ((("Retry-After-Ms", b"20"),), 0.02),
        ((("retry-after-ms", "-5"),), 0.0),
        ((("retry-after-ms", "soon"), ("grpc-retry-pushback-ms", "250")), 0.25),
        ((("retry-after-ms", "nan"), ("grpc-retry-pushback-ms", "inf")), None),
        ((("grpc-retry-pushback-ms", "-1"),), None),
        ((("x-other", "100"),), None),
        ((), None),
    ],
)
def test_retry_after_reads_either_trailer(
    metadata: tuple[tuple[str, str | bytes], ...], retry_after: float | None
) -> None:
    error = ResourceExhausted(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", metadata=metadata)
    assert error.retry_after == retry_after


def test_deadline_exceeded(client: Client, coordinator: ScriptedCoordinator) -> None:
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded) as caught:
        client.generate("slow", timeout=0.3)
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 3.0
    assert caught.value.attempts == coordinator.tries["slow"] == 1  # never retried


@pytest.mark.parametrize(
    ("prompt", "model", "error", "code"),
    [
        ("bad", None, InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
        ("Once upon a time", "nope", NotFound, grpc.StatusCode.NOT_FOUND),
        ("broken", None, Internal, grpc.StatusCode.INTERNAL),
        ("denied", None, PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    ],
)
def test_status_codes_map_to_typed_errors(
    client: Client,
    coordinator: ScriptedCoordinator,
    prompt: str,
    model: str | None,
    error: type[LayerlineError],
    code: grpc.StatusCode,
) -> None:
    with pytest.raises(LayerlineError) as caught:
        client.generate(prompt, model=model)
    assert type(caught.value) is error and caught.value.code == code
    assert caught.value.attempts == coordinator.tries[prompt] == 1  # none of these is retried


def test_a_stream_without_a_final_message_is_an_error(client: Client) -> None:
    with pytest.raises(Internal, match="ended without a finish_reason"):
        client.generate("no finish")


def test_closing_a_stream_early_cancels_the_call(client: Client, coordinator: ScriptedCoordinator) -> None:
    chunks = client.stream("endless")
    assert next(chunks).token_ids == [0]
    chunks.close()
    assert coordinator.cancelled.wait(5.0)


def test_unreachable_server_is_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with Client(f"127.0.0.1:{port}", retries=2) as c:
        with pytest.raises(Unavailable) as generating:
            c.generate("Once upon a time", timeout=5.0)
        with pytest.raises(Unavailable) as listing:
            c.models(timeout=5.0)
        with pytest.raises(Unavailable) as checking:
            c.health(timeout=5.0)
    assert (generating.value.attempts, listing.value.attempts, checking.value.attempts) == (3, 3, 1)


def test_a_server_does_not_share_a_port_another_grpc_server_holds(server: tuple[str, ScriptedCoordinator]) -> None:
    """The scripted coordinator listens with gRPC's defaults (SO_REUSEPORT); ours refuse its port."""
    address, _ = server
    ours = grpc.server(futures.ThreadPoolExecutor(max_workers=1), options=server_options())
    with pytest.raises(OSError, match=f"cannot listen on {address}: the port is in use"):
        listen(ours, address)
    ours.stop(None)


def test_models_and_cluster(client: Client) -> None:
    assert client.models() == [ModelInfo("d1g", "smollm2", 30, 2)]
    assert client.cluster() == ClusterStatus(
        workers=[
            WorkerStatus(
                address="127.0.0.1:7101",
                host="node-a",
                pid=4242,
                instance_id="i-1",
                model_id="d1g",
                model_name="smollm2",
                layers=(0, 15),
                num_layers=30,
                replica=0,
                tp=2,
                state="SERVING",
                dtype="bfloat16",
                device="cpu",
                load=WorkerLoad(3, 5, 500, 512),
                seconds_since_heartbeat=0.5,
            ),
            WorkerStatus(
                address="127.0.0.1:7102",
                host="node-b",
                pid=77,
                instance_id="i-2",
                model_id="d1g",
                model_name="smollm2",
                layers=(15, 30),
                num_layers=30,
                replica=None,
                tp=1,
                state="DRAINING",
                dtype="float32",
                device="cpu",
                load=WorkerLoad(0, 0, 64, 64),
                seconds_since_heartbeat=2.0,
            ),
        ],
        chains=[ChainStatus(0, "d1g", ["127.0.0.1:7101", "127.0.0.1:7103"], 5)],
        active_requests=5,
        queued_requests=1,
    )


def test_health_against_the_standard_health_servicer(client: Client) -> None:
    assert client.health() == "SERVING"
    assert client.health("layerline.v1.Coordinator") == "NOT_SERVING"
    with pytest.raises(NotFound):
        client.health("no.such.Service")


def test_health_messages_match_the_standard_encoding() -> None:
    for service in ("", "layerline.v1.Coordinator"):
        assert wire.encode_health_request(service) == health_pb2.HealthCheckRequest(service=service).SerializeToString()
    for status, name in [(0, "UNKNOWN"), (1, "SERVING"), (2, "NOT_SERVING"), (3, "SERVICE_UNKNOWN")]:
        assert wire.decode_health_response(health_pb2.HealthCheckResponse(status=status).SerializeToString()) == name


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"max_tokens": 2.0}, "max_tokens must be an int, got 2.0"),
        ({"max_tokens": True}, "max_tokens must be an int, got True"),
        ({"temperature": -0.1}, "temperature must be >= 0, got -0.1"),
        ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
        ({"top_p": 0.0}, "top_p must be > 0, got 0.0"),
        ({"top_p": 1.5}, "top_p must be <= 1, got 1.5"),
        ({"top_k": -1}, "top_k must be >= 0, got -1"),
        ({"min_p": 2}, "min_p must be <= 1, got 2"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0, got 0"),
        ({"seed": 2**64}, f"seed must be <= {2**64 - 1}, got {2**64}"),
        ({"seed": -1}, "seed must be >= 0, got -1"),
        ({"stop": [""]}, "stop must hold non-empty strs, got ''"),
        ({"stop": 5}, "stop must be a str or a list of str, got int"),
        ({"logprobs": -1}, "logprobs must be >= 0, got -1"),
        ({"timeout": 0}, "timeout must be > 0, got 0"),
        ({"retries": -1}, "retries must be >= 0, got -1"),
        ({"retries": 1.0}, "retries must be an int, got 1.0"),
        ({"model": 3}, "model must be a str or None, got int"),
    ],
)
def test_bad_arguments_raise_before_anything_is_sent(
    client: Client, coordinator: ScriptedCoordinator, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as caught:
        client.stream("Once upon a time", **kwargs)
    assert str(caught.value) == message
    assert coordinator.received == []


OPTIONS_HINT = (
    "the options are max_tokens, temperature, top_p, top_k, min_p, repetition_penalty, seed, stop, logprobs, "
    "speculate, model, timeout, retries"
)


@pytest.mark.parametrize(
    ("method", "query"),
    [("generate", "Once upon a time"), ("stream", "Once upon a time"), ("chat", MESSAGES), ("chat_stream", MESSAGES)],
)
def test_an_unknown_keyword_is_a_type_error_naming_it(
    client: Client, coordinator: ScriptedCoordinator, method: str, query: Any
) -> None:
    with pytest.raises(TypeError) as caught:
        getattr(client, method)(query, max_tokens=4, max_token=32)
    assert str(caught.value) == f"unexpected keyword argument 'max_token'; {OPTIONS_HINT}"
    assert coordinator.received == []


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "messages must be a non-empty list of {'role': ..., 'content': ...} dicts"),
        ("Hi", "messages must be a non-empty list of {'role': ..., 'content': ...} dicts"),
        ([{"content": "Hi"}], "messages[0]['role'] must be a non-empty str, got None"),
        ([{"role": "user", "content": 1}], "messages[0]['content'] must be a str, got int"),
    ],
)
def test_bad_messages_raise(client: Client, messages: Any, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        client.chat(messages)
    assert str(caught.value) == message


def test_a_closed_client_makes_no_calls(server: tuple[str, ScriptedCoordinator]) -> None:
    with Client(server[0]) as c:
        assert c.health() == "SERVING"
    with pytest.raises(ValueError, match="closed channel"):
        c.health()


def test_trace_context_goes_into_the_metadata_only_with_opentelemetry(
    client: Client, coordinator: ScriptedCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("caller") as span:
        client.generate("Once upon a time")
        chunks = client.stream("Once upon a time")  # the context at the call, not at iteration
    list(chunks)
    client.generate("Once upon a time")  # no current span: nothing to propagate
    monkeypatch.setattr(tracing, "propagate", None)  # as if OpenTelemetry were not installed
    with tracer.start_as_current_span("caller"):
        client.generate("Once upon a time")
    ctx = span.get_span_context()
    expected = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
    assert [r.metadata.get("traceparent") for r in coordinator.received] == [expected, expected, None, None]


def test_async_client_mirrors_the_sync_one(
    server: tuple[str, ScriptedCoordinator], coordinator: ScriptedCoordinator
) -> None:
    async def main() -> None:
        async with AsyncClient(server[0]) as c:
            assert await c.generate("Once upon a time", max_tokens=32, temperature=0.0) == STORY_COMPLETION
            assert [chunk async for chunk in c.stream("Once upon a time")] == STORY_CHUNKS
            assert await c.chat([{"role": "user", "content": "Hi"}]) == STORY_COMPLETION
            assert [chunk async for chunk in c.chat_stream([{"role": "user", "content": "Hi"}])] == STORY_CHUNKS
            assert await c.models() == [ModelInfo("d1g", "smollm2", 30, 2)]
            assert (await c.cluster()).workers[1].state == "DRAINING"
            assert await c.health() == "SERVING"
            assert await c.health("layerline.v1.Coordinator") == "NOT_SERVING"

    run(main())
    sampling = coordinator.received[0].request.sampling
    assert [f.name for f, _ in sampling.ListFields()] == ["max_tokens", "temperature"]


def test_async_errors_are_typed(server: tuple[str, ScriptedCoordinator], coordinator: ScriptedCoordinator) -> None:
    async def main() -> None:
        async with AsyncClient(server[0]) as c:
            chunks = c.stream("fail midway")
            assert await anext(chunks) == STORY_CHUNKS[0]
            with pytest.raises(Unavailable) as unavailable:
                await anext(chunks)
            assert unavailable.value.details == UNAVAILABLE_DETAILS
            with pytest.raises(ResourceExhausted) as busy:
                await c.generate("busy", retries=0)
            assert busy.value.retry_after == 1.5 and busy.value.details == BUSY_DETAILS
            with pytest.raises(DeadlineExceeded):
                await c.generate("slow", timeout=0.3)
            with pytest.raises(NotFound):
                await c.health("no.such.Service")
            with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
                c.stream("Once upon a time", max_tokens=0)
            with pytest.raises(TypeError) as unknown:
                c.chat_stream(MESSAGES, temprature=0.5)  # type: ignore[call-arg]
            assert str(unknown.value) == f"unexpected keyword argument 'temprature'; {OPTIONS_HINT}"
            with pytest.raises(TypeError) as unknown:
                await c.generate("Once upon a time", seeds=3)  # type: ignore[call-arg]
            assert str(unknown.value) == f"unexpected keyword argument 'seeds'; {OPTIONS_HINT}"
            async with aclosing(c.stream("endless")) as endless:
                assert (await anext(endless)).token_ids == [0]

    run(main())
    assert coordinator.cancelled.wait(5.0)
    assert coordinator.tries["fail midway"] == 1


def test_async_retries_mirror_the_sync_ones(
    server: tuple[str, ScriptedCoordinator], coordinator: ScriptedCoordinator
) -> None:
    async def main() -> None:
        async with AsyncClient(server[0], retries=1) as c:
            assert await c.generate("unavailable once") == STORY_COMPLETION
            with pytest.raises(ResourceExhausted) as busy:
                await c.generate("busy twice")
            assert busy.value.attempts == 2
            assert [chunk async for chunk in c.chat_stream([{"role": "user", "content": "busy twice"}])] == STORY_CHUNKS
            with pytest.raises(Unavailable) as down:
                await c.generate("down", retries=3)
            assert down.value.attempts == 4
            with pytest.raises(ValueError, match="retries must be >= 0, got -2"):
                AsyncClient(server[0], retries=-2)

    run(main())
    assert coordinator.tries == Counter({"unavailable once": 2, "busy twice": 3, "down": 4})


@pytest.mark.cluster
def test_importing_the_sdk_imports_neither_torch_nor_numpy() -> None:
    code = "import sys; import layerline.client; assert 'torch' not in sys.modules and 'numpy' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
