"""The OpenAI-compatible HTTP API, through the official `openai` client, on real clusters.

A 2-stage cluster of the real model with bearer tokens on: its greedy answers over HTTP equal
the gRPC SDK's token for token, streams reassemble to the whole answer with their usage, each
refusal has OpenAI's error shape and status (and the client's matching exception), 16 streams
complete at once, and a client that closes mid-stream frees its KV on both stages. A tiny model's
coordinator with one generation slot and no queue answers 429 with Retry-After, and one with no
workers answers 503.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from layerline.bench.openai_streams import check_http_is_grpc, http_aggregate, http_single
from layerline.client import AsyncClient, Client
from layerline.launcher import ClusterPlan, LocalCluster
from layerline.protos.v1 import stage_pb2, stage_pb2_grpc

from .stage_client import free_port
from .tiny_models import make_tiny_checkpoint, write_byte_tokenizer

pytestmark = [pytest.mark.real_model, pytest.mark.cluster]

PROMPTS = ["Once upon a time", "The three primary colors are", "def fibonacci(n):", "Water boils at"]
TOKEN = "http-test-token"


@pytest.fixture(scope="module")
def cluster(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    logs = tmp_path_factory.mktemp("http-logs")
    tokens = logs / "tokens"
    tokens.write_text(TOKEN + "\n")
    plan = ClusterPlan(
        model=str(real_model_dir),
        stages=2,
        port=free_port(),
        http_port=free_port(),
        log_dir=logs,
        kv_memory="64M",
        api_tokens=str(tokens),
        admin_tokens=str(tokens),
        coordinator_args=("--prefix-cache", "0"),  # a finished request's KV is freed: the KV test counts blocks
    )
    local = LocalCluster(plan, real_model_dir)
    local.start()
    try:
        local.wait_ready(timeout=180)
        yield local
    finally:
        local.stop()


def _openai(cluster: LocalCluster, **options: object) -> openai.OpenAI:
    assert cluster.http_url is not None
    return openai.OpenAI(base_url=cluster.http_url, api_key=TOKEN, max_retries=0, **options)  # type: ignore[arg-type]


def test_greedy_completions_equal_the_grpc_sdk_token_for_token(cluster: LocalCluster) -> None:
    http = _openai(cluster)
    with Client(cluster.address, token=TOKEN) as sdk:
        for prompt in PROMPTS:
            want = sdk.generate(prompt, max_tokens=16, temperature=0.0)
            got = http.completions.create(model="", prompt=prompt, max_tokens=16, temperature=0, logprobs=0)
            assert got.choices[0].text == want.text
            assert got.choices[0].finish_reason == want.finish_reason
            assert got.usage is not None and got.usage.completion_tokens == len(want.token_ids)
            chat = http.chat.completions.create(
                model=http.models.list().data[0].id,
                messages=[{"role": "user", "content": prompt}],
                max_completion_tokens=12,
                temperature=0,
                logprobs=True,
                top_logprobs=2,
            )
            answer = sdk.chat([{"role": "user", "content": prompt}], max_tokens=12, temperature=0.0)
            entries = chat.choices[0].logprobs.content  # type: ignore[union-attr]
            assert [e.model_extra["token_id"] for e in entries] == answer.token_ids  # type: ignore[index]
            assert chat.choices[0].message.content == answer.text
            assert all(len(e.top_logprobs) == 2 for e in entries)


def test_a_streamed_chat_with_usage_reassembles_to_the_whole_answer(cluster: LocalCluster) -> None:
    http = _openai(cluster)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = http.chat.completions.create(model="", messages=messages, max_tokens=20, temperature=0)  # type: ignore[arg-type]
    chunks = list(
        http.chat.completions.create(
            model="",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and "Paris" in text
    assert chunks[0].choices[0].delta.role == "assistant"
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [whole.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.model_dump() == whole.usage.model_dump()  # type: ignore[union-attr]


def test_models_name_the_model_and_health_says_a_chain_serves(cluster: LocalCluster) -> None:
    models = _openai(cluster).models.list().data
    assert [m.id for m in models] == ["smollm2-135m-instruct"]
    assert cluster.http_url is not None
    with urllib.request.urlopen(cluster.http_url.removesuffix("/v1") + "/health", timeout=10) as reply:
        assert reply.status == 200 and json.loads(reply.read())["chains"] == 1


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        (dict(temperature=-1.0), openai.BadRequestError, "temperature = -1.0 must be in [0, 100]"),
        (dict(n=2), openai.BadRequestError, "n = 2: only n = 1 is served"),
        (dict(frequency_penalty=0.5), openai.BadRequestError, "frequency_penalty = 0.5 is not served"),
        (dict(max_tokens=0), openai.BadRequestError, "max_tokens = 0 must be >= 1"),
        (dict(model="no-such-model"), openai.NotFoundError, "model 'no-such-model' is not served here"),
        (dict(seed=-1), openai.BadRequestError, "seed = -1 must be in [0, 2**64)"),  # gRPC's uint64 cannot say it
        (dict(extra_body={"top_k": 2**32}), openai.BadRequestError, "top_k = 4294967296 must be in [0, 2**32)"),
        (dict(extra_body={"ignore_eos": True}), openai.BadRequestError, "ignore_eos is not served"),
    ],
)
def test_each_bad_request_gets_openais_error_shape_and_status(cluster, options, error, words) -> None:  # type: ignore[no-untyped-def]
    http = _openai(cluster)
    request = {"model": "", "prompt": "Hello", "max_tokens": 4, **options}
    with pytest.raises(error) as raised:
        http.completions.create(**request)
    assert words in raised.value.message
    body = raised.value.body
    assert isinstance(body, dict) and words in body["message"] and body["type"].endswith("_error")


def _post(url: str, data: bytes, *, timeout: float = 30) -> tuple[int, dict]:  # type: ignore[type-arg]
    request = urllib.request.Request(url, data=data, headers={"Authorization": f"bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_what_no_client_should_send_gets_an_openai_error_not_a_500(cluster: LocalCluster) -> None:
    url = cluster.http_url
    assert url is not None
    deep = b"[" * 100_000 + b"]" * 100_000
    for data, status, words in [
        (deep, 400, "not JSON"),
        (b"{", 400, "not JSON"),
        (b'{"prompt": "\\ud800abc"}', 400, "prompt is not valid Unicode text"),  # a lone surrogate, escaped
        (b'{"prompt": "x"' + b" " * (3 << 20) + b"}", 413, "request body is over"),
        (json.dumps({"prompt": [1, 2, 3]}).encode(), 400, "prompt as token ids is not served"),
        (json.dumps({"prompt": "x", "stream_options": {"include_usage": True}}).encode(), 400, "needs stream"),
    ]:
        got, body = _post(url + "/completions", data)  # the scheme's case does not matter (RFC 7235)
        assert (got, body["error"]["type"]) == (status, error_type(status)), body
        assert words in body["error"]["message"]
    got, body = _post(url + "/no-such-path", b"{}")
    assert got == 404 and body["error"]["type"] == "not_found_error"


def error_type(status: int) -> str:
    return {400: "invalid_request_error", 413: "invalid_request_error"}[status]


def test_a_missing_or_wrong_token_gets_401(cluster: LocalCluster) -> None:
    assert cluster.http_url is not None
    for key in ("wrong-token", ""):
        http = openai.OpenAI(base_url=cluster.http_url, api_key=key or "none", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            http.models.list()
    request = urllib.request.Request(cluster.http_url + "/models")  # no Authorization header at all
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=10)
    assert raised.value.code == 401


def test_sixteen_concurrent_streams_all_complete(cluster: LocalCluster) -> None:
    assert cluster.http_url is not None

    async def run() -> list[tuple[str, str | None]]:
        http = openai.AsyncOpenAI(base_url=cluster.http_url, api_key=TOKEN, max_retries=0)

        async def one(i: int) -> tuple[str, str | None]:
            text, reason = "", None
            stream = await http.completions.create(
                model="", prompt=f"{PROMPTS[i % 4]} ({i})", max_tokens=12, temperature=0, stream=True
            )
            async for chunk in stream:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            return text, reason

        try:
            return await asyncio.gather(*(one(i) for i in range(16)))
        finally:
            await http.close()

    results = asyncio.run(run())
    assert len(results) == 16 and all(reason in ("length", "stop") and text for text, reason in results)


def test_the_bench_measures_http_as_it_measures_grpc(cluster: LocalCluster) -> None:
    """`layerline bench`'s HTTP figures, shortened: the SDK's greedy text, a stream's rate, 4 streams' tokens."""
    check_http_is_grpc(cluster, PROMPTS[2], 12)
    one = http_single(cluster, PROMPTS[2], 12)
    assert 0 < one.ttft_s < 30 and one.decode_tokens_per_s > 0 and one.median_gap_ms > 0
    assert http_aggregate(cluster, PROMPTS[3], 4, 12) > 0


def test_a_client_that_closes_mid_stream_frees_its_kv_on_both_stages(cluster: LocalCluster) -> None:
    def kv() -> dict[str, tuple[int, int]]:
        out = {}
        for address in addresses:
            with grpc.insecure_channel(address) as channel:
                info = stage_pb2_grpc.StageWorkerStub(channel).Info(stage_pb2.InfoRequest(), timeout=10).worker
                out[address] = (info.kv_blocks_free, info.kv_blocks_total)
        return out

    def settled() -> dict[str, tuple[int, int]]:
        deadline, now = time.monotonic() + 15, kv()
        while any(f != t for f, t in now.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
            now = kv()
        return now

    with Client(cluster.address, token=TOKEN) as sdk:
        addresses = [w.address for w in sdk.cluster().workers]
    assert all(f == t for f, t in settled().values())
    stream = _openai(cluster).completions.create(
        model="", prompt=PROMPTS[0] * 20, max_tokens=200, temperature=0, stream=True
    )
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    during = kv()
    assert all(f < t for f, t in during.values()), during  # the long prompt holds blocks on both
    stream.close()  # the client goes away mid-generation
    after = settled()
    assert all(f == t for f, t in after.values()), after


# -- admission and no chain: a tiny model's coordinator -------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-http")
    make_tiny_checkpoint("smollm2", path, num_layers=2, vocab_size=259)
    assert write_byte_tokenizer(path) == 259
    for name, changes in [  # no end-of-sequence token: every answer runs to its max_tokens
        ("config.json", {"max_position_embeddings": 8192, "eos_token_id": None}),
        ("generation_config.json", {"eos_token_id": None}),
        ("tokenizer_config.json", {"eos_token": None}),
    ]:
        config = json.loads((path / name).read_text())
        (path / name).write_text(json.dumps({**config, **changes}))
    return path


def test_a_full_queue_gets_429_with_retry_after(tiny: Path, tmp_path: Path) -> None:
    plan = ClusterPlan(
        model=str(tiny),
        stages=1,
        port=free_port(),
        http_port=free_port(),
        log_dir=tmp_path,
        threads=1,
        coordinator_args=("--max-active", "1", "--max-queued", "1"),
    )
    cluster = LocalCluster(plan, tiny)
    cluster.start()
    try:
        cluster.wait_ready(timeout=120)
        http = _openai(cluster)
        holder = http.completions.create(model="", prompt="hold", max_tokens=4000, temperature=0, stream=True)
        next(iter(holder))  # the one slot is taken
        waiting = threading.Thread(
            target=lambda: http.completions.create(model="", prompt="wait", max_tokens=4), daemon=True
        )
        waiting.start()  # the one place in the queue is taken
        deadline = time.monotonic() + 30
        with Client(cluster.address) as sdk:
            while sdk.cluster().queued_requests < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        with pytest.raises(openai.RateLimitError) as raised:
            http.completions.create(model="", prompt="refused", max_tokens=4)
        holder.close()
        waiting.join(30)
        # A client that leaves before its whole (non-streamed) answer cancels it at once.
        with pytest.raises((TimeoutError, urllib.error.URLError)):
            _post(f"{cluster.http_url}/completions", b'{"prompt": "long", "max_tokens": 8000}', timeout=1)
        with Client(cluster.address) as sdk:
            deadline = time.monotonic() + 10
            while sdk.cluster().active_requests and time.monotonic() < deadline:
                time.sleep(0.1)
            left = sdk.cluster().active_requests
    finally:
        cluster.stop()
    assert raised.value.status_code == 429
    assert raised.value.response.headers["retry-after"] == "1"
    assert "max_queued = 1" in raised.value.message
    assert left == 0


def test_a_coordinator_without_a_chain_answers_503(tiny: Path, tmp_path: Path) -> None:
    port, http_port = free_port(), free_port()
    with (tmp_path / "coordinator.log").open("wb") as log:
        coordinator = subprocess.Popen(
            [
                *(sys.executable, "-m", "layerline", "coordinator", "--model", str(tiny), "--port", str(port)),
                *("--cluster-port", str(free_port()), "--http-port", str(http_port)),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
            except urllib.error.HTTPError as err:
                health = err.code
                break
            except OSError:
                assert time.monotonic() < deadline, (tmp_path / "coordinator.log").read_text()
                time.sleep(0.2)
        http = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError) as raised:
            http.completions.create(model="", prompt="anyone?", max_tokens=4)
    finally:
        coordinator.terminate()
        coordinator.wait(30)
    assert health == 503
    assert raised.value.status_code == 503 and "no complete chain" in raised.value.message


def test_the_grpc_api_is_unchanged_beside_http(cluster: LocalCluster) -> None:
    async def run() -> str:
        async with AsyncClient(cluster.address, token=TOKEN) as client:
            return (await client.generate(PROMPTS[1], max_tokens=8, temperature=0.0)).text

    assert asyncio.run(run())
