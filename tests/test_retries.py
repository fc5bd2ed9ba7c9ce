"""The SDK's retries before the first token: the policy on its own, then with real processes.

The real-process tests share one cluster: a coordinator (`--max-active 1 --max-queued 1`) and
one stage worker of a tiny random model with a byte-level tokenizer, a long context and no
end-of-sequence token, so that an answer of `LONG` tokens outlasts each test's steps. They kill
the coordinator and start it again on the same ports (the stage registers with it again), under
a client's call.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from layerline.cli import main
from layerline.client import (
    AsyncClient,
    Client,
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from layerline.client.retry import GENERATE_CODES, INFO_CODES, Attempts, Limits, backoff
from layerline.launcher import ClusterPlan, LocalCluster

from .stage_client import free_port
from .tiny_models import make_tiny_checkpoint, write_byte_tokenizer

PROMPT = "Once upon a time"
CONTEXT = 8192  # the tiny model's context: room for an answer that lasts seconds
LONG = 8000  # tokens of an answer the test stops (or loses) long before its end
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def retries(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """The retries the SDK logs from now on (on any thread), as messages."""
    caplog.set_level(logging.INFO, logger="layerline.client")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "layerline.client"]


def busy(hint_ms: str | None = None) -> ResourceExhausted:
    metadata = () if hint_ms is None else (("retry-after-ms", hint_ms),)
    return ResourceExhausted(RESOURCE_EXHAUSTED, "queue full", metadata=metadata)


def test_backoff_doubles_from_0_2_s_up_to_5_s_drawn_from_the_upper_half() -> None:
    highest = [backoff(retry, rng=lambda: 1.0) for retry in range(1, 8)]
    lowest = [backoff(retry, rng=lambda: 0.0) for retry in range(1, 8)]
    assert highest == pytest.approx([0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0])
    assert lowest == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 2.5, 2.5])
    assert 0.1 <= backoff(1) < 0.2


def test_the_retry_hint_replaces_the_backoff_and_no_wait_ends_past_the_deadline() -> None:
    clock = Clock()
    attempts = Attempts(Limits(timeout=10.0, retries=5), GENERATE_CODES, clock=clock, rng=lambda: 0.0)
    assert attempts.start() == 10.0
    assert attempts.wait_before_retry(busy("3000")) == 3.0
    clock.now = 3.0
    assert attempts.start() == 7.0  # what is left of the call's timeout
    assert attempts.wait_before_retry(busy()) == pytest.approx(0.2)  # no hint: the second retry's backoff
    clock.now = 3.2
    attempts.start()
    late = busy("6800")
    assert attempts.wait_before_retry(late) is None  # would end at 10.0 s, the deadline
    assert late.attempts == 3


def test_only_not_now_statuses_are_retried_before_any_answer_within_the_bound() -> None:
    def first_wait(error: Exception, codes: frozenset[grpc.StatusCode] = GENERATE_CODES, **kw: bool) -> float | None:
        attempts = Attempts(Limits(600.0, 2), codes, rng=lambda: 0.0)
        attempts.start()
        return attempts.wait_before_retry(error, **kw)  # type: ignore[arg-type]

    unavailable = Unavailable(grpc.StatusCode.UNAVAILABLE, "no complete chain")
    assert first_wait(unavailable) == pytest.approx(0.1)
    assert first_wait(busy("250")) == 0.25
    assert first_wait(unavailable, answered=True) is None  # a token had arrived
    assert first_wait(busy("250"), INFO_CODES) is None  # an info call's RESOURCE_EXHAUSTED is a size limit
    assert first_wait(unavailable, INFO_CODES) == pytest.approx(0.1)
    assert first_wait(InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens")) is None
    assert first_wait(DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, "late")) is None
    bounded = Attempts(Limits(600.0, 2), GENERATE_CODES, rng=lambda: 0.0)
    waits = []
    for _ in range(3):
        bounded.start()
        waits.append(bounded.wait_before_retry(unavailable))
    assert waits == [pytest.approx(0.1), pytest.approx(0.2), None] and unavailable.attempts == 3


def test_the_retries_flag_of_the_client_commands(
    retries: Callable[[], list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    target = f"127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["generate", "--target", target, "--retries", "2", "hi"]) == 2
    assert capsys.readouterr().err.startswith("error: UNAVAILABLE: ")
    assert [m.rpartition("; ")[2][:10] for m in retries()] == ["retry 1 of", "retry 2 of"]
    assert main(["generate", "--target", target, "--retries", "-1", "hi"]) == 2
    assert capsys.readouterr().err == "error: retries must be >= 0, got -1\n"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random SmolLM2-shaped model of 4 layers with a byte-level tokenizer, its context
    CONTEXT, and no end-of-sequence token: every answer runs to its max_tokens."""
    path = tmp_path_factory.mktemp("tiny-retries")
    make_tiny_checkpoint("smollm2", path, num_layers=4, vocab_size=259)
    assert write_byte_tokenizer(path) == 259
    for name, changes in [
        ("config.json", {"max_position_embeddings": CONTEXT, "eos_token_id": None}),
        ("generation_config.json", {"eos_token_id": None}),
        ("tokenizer_config.json", {"eos_token": None}),
    ]:
        config = json.loads((path / name).read_text())
        (path / name).write_text(json.dumps({**config, **changes}))
    return path


class Coordinator:
    """The cluster's coordinator process, killed and started again on the same ports."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return dict(self.cluster.procs)["coordinator"]

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def start(self) -> None:
        """The same command again, on the same ports, its output after the last one's."""
        self.cluster.supervisor.restart("coordinator")


@pytest.fixture(scope="module")
def cluster(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    plan = ClusterPlan(
        model=str(checkpoint),
        layer_ranges=((0, 4),),
        port=free_port(),
        log_dir=tmp_path_factory.mktemp("retries-logs"),
        kv_memory="16M",
        threads=1,
        coordinator_args=("--max-active", "1", "--max-queued", "1"),
    )
    cluster = LocalCluster(plan, checkpoint)
    cluster.start()
    try:
        cluster.wait_ready(timeout=180)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def coordinator(cluster: LocalCluster) -> Coordinator:
    """The coordinator, serving with its chain ready (started again if a test killed it)."""
    coordinator = Coordinator(cluster)
    if coordinator.process.poll() is not None:
        coordinator.start()
    cluster.wait_ready(timeout=60)
    return coordinator


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_a_call_made_while_the_coordinator_is_down_succeeds_once_it_is_back(
    cluster: LocalCluster, coordinator: Coordinator, retries: Callable[[], list[str]]
) -> None:
    with Client(cluster.address) as client:
        reference = client.generate(PROMPT, max_tokens=4, temperature=0.0)
    coordinator.kill()
    with Client(cluster.address, retries=0) as client, pytest.raises(Unavailable) as down:
        client.generate(PROMPT, max_tokens=4, temperature=0.0)
    assert down.value.attempts == 1 and retries() == []
    back = threading.Timer(1.0, coordinator.start)
    back.start()
    try:
        with Client(cluster.address, retries=12) as client:
            done = client.generate(PROMPT, max_tokens=4, temperature=0.0, timeout=120)
    finally:
        back.join()
    assert done == reference and done.finish_reason == "length"
    # Refused while the coordinator was down, and while its stage registered again.
    assert retries() and all(m.startswith("UNAVAILABLE: ") for m in retries()), retries()


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_a_call_refused_at_the_door_is_made_again_after_the_retry_hint(
    cluster: LocalCluster, coordinator: Coordinator, retries: Callable[[], list[str]]
) -> None:
    """One call generates (the one slot), one waits (the one place in the queue), the third is
    refused with the coordinator's hint (1 s); the first stops, and the third passes when retried."""

    async def main() -> tuple[int, int, float]:
        async with AsyncClient(cluster.address) as client:
            holder = client.stream(PROMPT, max_tokens=LONG, temperature=0.0)
            await anext(holder)
            queued = asyncio.create_task(client.generate(PROMPT, max_tokens=4, temperature=0.0))
            while (await client.cluster()).queued_requests < 1:
                await asyncio.sleep(0.05)
            start = time.monotonic()
            refused = asyncio.create_task(client.generate(PROMPT, max_tokens=4, temperature=0.0))
            while not retries() and not refused.done():
                await asyncio.sleep(0.02)
            await holder.aclose()  # its slot frees: the queued call generates, the queue empties
            waited, done = await queued, await refused
            return len(waited.token_ids), len(done.token_ids), time.monotonic() - start

    waited, done, seconds = asyncio.run(main())
    assert (waited, done) == (4, 4)
    assert len(retries()) == 1 and retries()[0].startswith("RESOURCE_EXHAUSTED: "), retries()
    assert "(max_active = 1, max_queued = 1)" in retries()[0] and retries()[0].endswith("retry 1 of 3 in 1.00 s")
    assert seconds >= 1.0  # it waited the hint, not the 0.1-0.2 s of a first backoff


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_a_stream_that_loses_its_coordinator_after_a_token_is_not_made_again(
    cluster: LocalCluster, coordinator: Coordinator, retries: Callable[[], list[str]]
) -> None:
    with Client(cluster.address, retries=5) as client:
        chunks = client.stream(PROMPT, max_tokens=LONG, temperature=0.0)
        assert next(chunks).token_ids
        coordinator.kill()  # SIGKILL, mid-answer
        with pytest.raises(Unavailable) as lost:
            for _ in chunks:
                pass
    assert lost.value.attempts == 1 and retries() == []
