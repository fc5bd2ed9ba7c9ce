"""What the coordinator accepts from clients and workers, against its real services in this process.

A `CoordinatorServicer` on a real grpc.aio server on 127.0.0.1 with the real SmolLM2 tokenizer and
no stage worker: every request ends at a refusal or, once admitted and tokenized, at UNAVAILABLE
(no chain). The text model is wrapped to record the thread of every tokenization. Readiness
probes run against fake StageWorker servers that answer badly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest

from layerline.coordinator import cluster as cluster_module
from layerline.coordinator.chain import MemberLinks, ProbeFailed, probe
from layerline.coordinator.cluster import Cluster
from layerline.coordinator.members import RegistryServicer
from layerline.coordinator.registry import Registry, Worker
from layerline.coordinator.requests import Admission
from layerline.coordinator.servicer import CoordinatorServicer
from layerline.coordinator.serving import Serving
from layerline.coordinator.telemetry import CoordinatorTelemetry
from layerline.coordinator.text import TextModel
from layerline.protos.v1 import common_pb2, coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc
from layerline.shared.rpc import channel_options, server_options
from layerline.shared.settings import TelemetrySettings
from layerline.shared.telemetry import Telemetry

pb = coordinator_pb2
BIG = 80 << 20  # message limit of the test server and channel: room for a 64 MiB prompt
MAX_CONTEXT = 8192  # SmolLM2's
Outcome = tuple[grpc.StatusCode, str]


@pytest.fixture(scope="module")
def real_text(real_model_dir: Path) -> TextModel:
    return TextModel.from_checkpoint(real_model_dir)


class Spied:
    """A text model that records the thread each tokenization ran on."""

    def __init__(self, text: TextModel) -> None:
        threads: list[threading.Thread] = []

        class Spy(type(text)):  # type: ignore[misc]
            def encode(self, prompt: str) -> list[int]:
                threads.append(threading.current_thread())
                return super().encode(prompt)

            def encode_chat(self, messages: Sequence[Mapping[str, str]], **options: Any) -> list[int]:
                threads.append(threading.current_thread())
                return super().encode_chat(messages, **options)

        self.text = Spy(**{f.name: getattr(text, f.name) for f in dataclasses.fields(text)})
        self.threads = threads


@asynccontextmanager
async def coordinator(text: TextModel, **limits: Any) -> AsyncIterator[coordinator_pb2_grpc.CoordinatorStub]:
    """A coordinator with no worker, serving `text` under `limits` (Admission fields)."""
    registry = Registry(num_layers=30)
    cluster = Cluster(registry, max_message_bytes=BIG, token_budget=64, links=MemberLinks(route_key=b"k" * 32))
    admission = Admission(
        **{
            "max_active": 2,
            "max_queued": 4,
            "rate_limit": 1000.0,
            "default_max_tokens": 4,
            "max_context": MAX_CONTEXT,
            **limits,
        }
    )
    telemetry = CoordinatorTelemetry(Telemetry(TelemetrySettings(), service="test"), model_name="smollm2")
    servicer = CoordinatorServicer(
        Serving(cluster, text, admission=admission, model_name="smollm2", telemetry=telemetry)
    )
    server = grpc.aio.server(options=server_options(BIG))
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options(BIG)) as channel:
            yield coordinator_pb2_grpc.CoordinatorStub(channel)
    finally:
        await server.stop(None)
        await cluster.close()


async def outcome(call: Any) -> Outcome:
    """How a streaming call ended: its status and details."""
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def generate(stub: coordinator_pb2_grpc.CoordinatorStub, prompt: str) -> Any:
    return stub.Generate(pb.GenerateRequest(prompt=prompt))


def chat(stub: coordinator_pb2_grpc.CoordinatorStub, *messages: tuple[str, str]) -> Any:
    return stub.Chat(pb.ChatRequest(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages]))


def words(n_bytes: int) -> str:
    """Prose-like text of about `n_bytes` bytes (slow to tokenize: about 1 MB per second)."""
    rng = random.Random(0)
    vocabulary = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "héllo", "世界", "1234", "\n"]
    return " ".join(rng.choice(vocabulary) for _ in range(n_bytes // 5))[:n_bytes]


NO_CHAIN = (grpc.StatusCode.UNAVAILABLE, "no complete chain of workers")


def no_chain(result: Outcome) -> bool:
    return result[0] == NO_CHAIN[0] and NO_CHAIN[1] in result[1]


# -- prompts ------------------------------------------------------------------------------------


def test_a_prompt_over_the_byte_cap_is_refused_at_once_without_tokenizing(real_text: TextModel) -> None:
    spied = Spied(real_text)

    async def main() -> tuple[Outcome, Outcome, float, Outcome]:
        async with coordinator(spied.text, max_prompt_bytes=1000) as stub:
            over = await outcome(generate(stub, "é" * 501))  # 501 characters, 1002 bytes
            huge = "x" * (64 << 20)
            started = time.monotonic()
            refused_huge = await outcome(generate(stub, huge))
            seconds = time.monotonic() - started
            at_the_cap = await outcome(generate(stub, "é" * 500))  # 1000 bytes: allowed
            return over, refused_huge, seconds, at_the_cap

    over, huge, seconds, at_the_cap = asyncio.run(main())
    for code, details in (over, huge):
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt" in details and "max_prompt_bytes = 1000" in details
    assert seconds < 5.0  # 64 MiB through loopback; tokenizing it would take a minute
    assert no_chain(at_the_cap), at_the_cap
    assert len(spied.threads) == 1  # only the prompt within the cap was tokenized


def test_tokenizing_runs_off_the_event_loop_after_admission(real_text: TextModel) -> None:
    spied = Spied(real_text)
    prompt = words(2_500_000)  # about 2 s of tokenizing; over the context in tokens

    async def main() -> tuple[Outcome, float, list[float], threading.Thread]:
        loop_thread = threading.current_thread()
        async with coordinator(spied.text, max_prompt_bytes=4 << 20) as stub:
            await stub.ListModels(pb.ListModelsRequest())  # the channel is up
            started = time.monotonic()
            call = asyncio.ensure_future(outcome(generate(stub, prompt)))
            latencies = []
            while not call.done():
                asked = time.monotonic()
                await stub.ListModels(pb.ListModelsRequest(), timeout=30)
                latencies.append(time.monotonic() - asked)
                await asyncio.sleep(0.05)
            return call.result(), time.monotonic() - started, latencies, loop_thread

    (code, details), seconds, latencies, loop_thread = asyncio.run(main())
    assert seconds > 0.5 and len(latencies) >= 3
    assert max(latencies) < seconds / 4, (latencies, seconds)  # on the loop, one call would wait it all out
    assert [t is loop_thread for t in spied.threads] == [False]
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"max_prompt_tokens = {MAX_CONTEXT}" in details, details


def test_a_full_queue_refuses_before_tokenizing(real_text: TextModel) -> None:
    spied = Spied(real_text)

    async def main() -> Outcome:
        async with coordinator(spied.text, max_active=0, max_queued=0) as stub:
            return await outcome(generate(stub, "Once upon a time"))

    code, details = asyncio.run(main())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queued = 0" in details
    assert spied.threads == []


def test_a_burst_admits_the_slots_and_the_queue_however_slowly_it_tokenizes(real_text: TextModel) -> None:
    """max_active 2 + max_queued 2 admit 4 of a burst of 6 even while its first prompts are still being
    tokenized: a request tokenizing with a slot free is headed for that slot, not waiting."""
    tokenizing = threading.Event()  # held until the whole burst has reached the door

    class Slow(type(real_text)):  # type: ignore[misc]
        def encode(self, prompt: str) -> list[int]:
            tokenizing.wait(timeout=30)
            return super().encode(prompt)

    slow = Slow(**{f.name: getattr(real_text, f.name) for f in dataclasses.fields(real_text)})

    async def main() -> list[Outcome]:
        async with coordinator(slow, max_active=2, max_queued=2) as stub:
            calls = [asyncio.ensure_future(outcome(generate(stub, "Once upon a time"))) for _ in range(6)]
            for _ in range(300):  # the refusals come at once; the admitted calls wait for their tokens
                if sum(c.done() for c in calls) >= 2:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # any further refusal would have come by now
            tokenizing.set()
            return list(await asyncio.gather(*calls))

    outcomes = asyncio.run(main())
    refused = [details for code, details in outcomes if code == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(refused) == 2, outcomes
    assert all("max_active = 2, max_queued = 2" in details for details in refused), refused
    assert sum(map(no_chain, outcomes)) == 4, outcomes


def test_a_prompt_over_the_token_cap_is_refused(real_text: TextModel) -> None:
    async def main() -> tuple[Outcome, Outcome]:
        async with coordinator(real_text, max_prompt_tokens=4) as stub:
            return (
                await outcome(generate(stub, "Once upon a time there was a king")),
                await outcome(generate(stub, "Once upon")),
            )

    (code, details), within = asyncio.run(main())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in details and "max_prompt_tokens = 4" in details
    assert no_chain(within), within


# -- chats --------------------------------------------------------------------------------------

CHAT_REFUSALS = {
    "too many messages": ([("user", "hi")] * 4, "max_chat_messages = 3"),
    "a long role": ([("r" * 65, "hi")], "messages[0].role"),
    "a long content": ([("user", "hi"), ("user", "x" * 201)], "messages[1].content"),
    "long contents together": ([("user", "x" * 80)] * 3, "max_prompt_bytes = 200"),
    "a long rendering": ([("user", "x" * 150)], "at most 200 may be (max_prompt_bytes)"),  # with a system turn
    "a special token in a role": ([("user<|im_end|>", "hi")], "messages[0].role"),
}


@pytest.mark.parametrize("case", list(CHAT_REFUSALS))
def test_chat_limits(real_text: TextModel, case: str) -> None:
    messages, expected = CHAT_REFUSALS[case]

    async def main() -> tuple[Outcome, Outcome]:
        async with coordinator(real_text, max_chat_messages=3, max_prompt_bytes=200) as stub:
            return await outcome(chat(stub, *messages)), await outcome(chat(stub, ("user", "hi")))

    (code, details), within = asyncio.run(main())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and expected in details, details
    assert no_chain(within), within


def test_chat_limits_are_checked_before_tokenizing(real_text: TextModel) -> None:
    spied = Spied(real_text)

    async def main() -> list[Outcome]:
        async with coordinator(spied.text, max_chat_messages=256, max_prompt_bytes=1 << 20) as stub:
            return [
                await outcome(chat(stub, *[("user", "hi")] * 257)),
                await outcome(chat(stub, ("user", "x" * ((1 << 20) + 1)))),
            ]

    results = asyncio.run(main())
    assert [code for code, _ in results] == [grpc.StatusCode.INVALID_ARGUMENT] * 2, results
    assert spied.threads == []


# -- readiness probes ---------------------------------------------------------------------------


class FakeStage(stage_pb2_grpc.StageWorkerServicer):
    """Answers Info as told: "serving", "unknown state" (an enum value no version defines) or "raises"."""

    def __init__(self, answer: str) -> None:
        self.answer = answer

    async def Info(self, request: stage_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> stage_pb2.InfoResponse:
        if self.answer == "raises":
            raise RuntimeError("a bug in the worker")
        reply = stage_pb2.InfoResponse(probe_seconds=0.01)
        reply.worker.state = common_pb2.WORKER_STATE_SERVING if self.answer == "serving" else 99
        return reply


@asynccontextmanager
async def fake_stages(*answers: str) -> AsyncIterator[list[str]]:
    servers, addresses = [], []
    for answer in answers:
        server = grpc.aio.server()
        stage_pb2_grpc.add_StageWorkerServicer_to_server(FakeStage(answer), server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        servers.append(server)
    try:
        yield addresses
    finally:
        for server in servers:
            await server.stop(None)


def worker(address: str, start: int, end: int) -> Worker:
    return Worker(
        address=address, instance_id="i", model_id="m", model_name="x", layer_start=start, layer_end=end, num_layers=30
    )


def test_a_probe_answer_with_an_unknown_state_is_a_failed_probe() -> None:
    async def main() -> None:
        async with fake_stages("unknown state") as (address,):
            with pytest.raises(ProbeFailed, match="unknown state 99"):
                await probe(address)

    asyncio.run(main())


def test_any_failure_of_one_workers_probe_leaves_the_others_probed(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> list[list[str]]:
        async with fake_stages("serving", "unknown state", "raises", "serving") as addresses:
            good, unknown, raises, broken = addresses

            async def probe_with_a_bug(address: str, **options: Any) -> float:
                if address == broken:
                    raise KeyError("a bug in the coordinator's probe")
                return await probe(address, **options)

            monkeypatch.setattr(cluster_module, "probe", probe_with_a_bug)
            registry = Registry(num_layers=30)
            for i, address in enumerate(addresses):  # no two tile [0, 30): no chain starts
                registry.register(worker(address, 0, 10 + i))
            cluster = Cluster(registry, max_message_bytes=BIG, token_budget=64, links=MemberLinks(route_key=b"k" * 32))
            rounds = []
            for _ in range(2):  # the failing ones are due again: the next round runs just the same
                await asyncio.gather(*cluster.probe_workers(every=60))
                rounds.append([w.address for w in registry.routable()])
            assert sorted(w.address for w in registry.due_for_probe(every=60)) == sorted([unknown, raises, broken])
            await cluster.close()
            return [r == [good] for r in rounds]

    assert asyncio.run(main()) == [True, True]


# -- registration -------------------------------------------------------------------------------


def test_a_register_past_max_workers_is_resource_exhausted() -> None:
    async def main() -> tuple[bool, grpc.StatusCode, str]:
        registry = Registry(num_layers=30, max_workers=1)
        cluster = Cluster(registry, max_message_bytes=BIG, token_budget=64, links=MemberLinks(route_key=b"k" * 32))
        server = grpc.aio.server()
        servicer = RegistryServicer(cluster, heartbeat_interval=1.0, route_key=b"k" * 32, tls=False)
        coordinator_pb2_grpc.add_RegistryServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = coordinator_pb2_grpc.RegistryStub(channel)

                def register(address: str) -> Any:
                    info = common_pb2.WorkerInfo(address=address, instance_id="i", num_layers=30, layer_end=15)
                    return stub.Register(pb.RegisterRequest(worker=info))

                first = await register("127.0.0.1:1")
                try:
                    await register("127.0.0.1:2")
                except grpc.aio.AioRpcError as err:
                    return first.known is False, err.code(), err.details() or ""
                return first.known is False, grpc.StatusCode.OK, ""
        finally:
            await server.stop(None)
            await cluster.close()

    registered, code, details = asyncio.run(main())
    assert registered and code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_workers = 1" in details, details


def test_the_maintenance_and_probe_loops_outlive_a_failing_round(caplog: pytest.LogCaptureFixture) -> None:
    """A round that raises is logged and the loop goes on; a dead loop would freeze routing."""
    from layerline.coordinator import server

    class Flaky:
        def __init__(self) -> None:
            self.rounds = 0

        def refresh(self) -> None:
            self.rounds += 1
            if self.rounds == 1:
                raise RuntimeError("a worker answered nonsense")

        def probe_workers(self, *, every: float) -> list[asyncio.Task[None]]:
            self.refresh()
            return []

    async def run() -> tuple[int, int]:
        maintained, probed = Flaky(), Flaky()
        tasks = [
            asyncio.create_task(server._maintain(maintained)),  # type: ignore[arg-type]
            asyncio.create_task(server._probe(probed, every=15.0)),  # type: ignore[arg-type]
        ]
        await asyncio.sleep(0.7)
        for task in tasks:
            task.cancel()
        return maintained.rounds, probed.rounds

    maintained, probed = asyncio.run(run())
    assert maintained >= 3 and probed >= 3
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        "maintenance round failed",
        "probe round failed",
    ]


@pytest.mark.cluster
def test_a_server_past_its_concurrent_calls_refuses_new_ones() -> None:
    """--max-concurrent-rpcs: a coordinator process bounded to one call refuses a second."""
    import subprocess
    import sys

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from .stage_client import free_port

    port, cluster_port = free_port(), free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "layerline",
            "coordinator",
            "--port",
            str(port),
            "--cluster-port",
            str(cluster_port),
            "--max-concurrent-rpcs",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 60
            while True:
                try:
                    health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline, "the coordinator did not start"
                    time.sleep(0.2)
            watch = health.Watch(health_pb2.HealthCheckRequest())  # holds the one call
            next(watch)
            with pytest.raises(grpc.RpcError) as refused:
                health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            watch.cancel()
    finally:
        process.terminate()
        process.wait(30)


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf"])
def test_a_probe_interval_that_is_not_a_positive_number_of_seconds_is_refused_by_name(bad: str, capsys) -> None:
    from layerline.cli import main

    assert main(["coordinator", "--probe-interval", bad]) == 2
    assert f"--probe-interval {float(bad)} must be a finite number of seconds above 0" in capsys.readouterr().err


def test_the_probe_interval_flag_reaches_the_coordinator_s_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from layerline.cli import main
    from layerline.coordinator import server
    from layerline.coordinator.settings import CoordinatorSettings

    seen: list[CoordinatorSettings] = []
    monkeypatch.setattr(server, "run_coordinator", lambda settings: seen.append(settings) or 0)
    assert main(["coordinator", "--probe-interval", "600"]) == 0
    assert main(["coordinator"]) == 0
    assert [s.probe_interval for s in seen] == [600.0, 15.0]
