"""Nothing fails that could have waited, with real processes on a tiny random model: a stage that
stops answering (SIGSTOP, or a stalled link while its heartbeats flow) is caught from the
chain's own step times and its sequences move; a chain short of KV preempts and recomputes
instead of failing requests. Every stream must equal a fault-free run token for token."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from layerline.client import AsyncClient, Client
from layerline.launcher import ClusterPlan, LocalCluster

from .stage_client import StageProcess, free_port
from .tiny_models import make_tiny_checkpoint, write_byte_tokenizer

pytestmark = [pytest.mark.cluster]

PROMPTS = [f"Request {i}: the quick brown fox jumps over the lazy dog." for i in range(16)]
HEARTBEAT_EXPIRY = 5.0  # the coordinator's default: a stall caught sooner was caught from step times


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random SmolLM2-shaped model of 4 layers and 1024 positions, with a byte-level tokenizer."""
    path = tmp_path_factory.mktemp("tiny-resilience")
    make_tiny_checkpoint("smollm2", path, num_layers=4, vocab_size=259)
    assert write_byte_tokenizer(path) == 259
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    return path


async def _streams(address: str, prompts: list[str], n: int, *, first: int = 0, on_token=None) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Each prompt's tokens, all streamed at once; the odd ones (counted from `first`) sampled under
    a seed, the even ones greedy."""
    async with AsyncClient(address) as client:

        async def one(i: int) -> list[int]:
            ids: list[int] = []
            k = first + i
            sampling = dict(temperature=0.8, seed=1000 + k) if k % 2 else dict(temperature=0.0)
            async for chunk in client.stream(prompts[i], max_tokens=n, **sampling):
                ids += chunk.token_ids
                if on_token is not None:
                    on_token(i, len(ids))
            return ids

        return await asyncio.gather(*(one(i) for i in range(len(prompts))))


def _tiny_cluster(checkpoint: Path, log_dir: Path, **plan: object) -> LocalCluster:
    cluster = LocalCluster(
        ClusterPlan(
            model=str(checkpoint), layer_ranges=((0, 2), (2, 4)), port=free_port(), log_dir=log_dir, threads=1, **plan
        ),  # type: ignore[arg-type]
        checkpoint,
    )
    cluster.start()
    try:
        cluster.wait_ready(timeout=120)
    except BaseException:
        cluster.stop()  # a start that fails leaves nothing running
        raise
    return cluster


@pytest.mark.timeout(240)
def test_a_sigstopped_stage_is_caught_from_its_chains_step_times_and_its_streams_move(checkpoint, tmp_path):
    cluster = _tiny_cluster(checkpoint, tmp_path, replicas=2, kv_memory="4M")
    try:
        reference = asyncio.run(_streams(cluster.address, PROMPTS, 48))
        victim = dict(cluster.procs)["stage-r0-2-4"]
        stopped_at: list[float] = []

        def maybe_stop(stream: int, tokens: int) -> None:
            if not stopped_at and tokens >= 8:
                victim.send_signal(signal.SIGSTOP)
                stopped_at.append(time.monotonic())

        faulty = asyncio.run(_streams(cluster.address, PROMPTS, 48, on_token=maybe_stop))
        victim.send_signal(signal.SIGCONT)
        with cluster.client() as client:
            status = client.cluster()
    finally:
        victim.send_signal(signal.SIGCONT)
        cluster.stop()
    assert stopped_at
    assert faulty == reference
    assert status.stalls >= 1 and status.failovers >= 1
    print(f"longest gap after the SIGSTOP: {status.max_failover_gap_seconds:.2f}s")
    assert status.max_failover_gap_seconds < HEARTBEAT_EXPIRY  # caught from step times, not heartbeats


@pytest.mark.timeout(300)
def test_a_stalled_link_is_caught_while_heartbeats_flow_and_the_worker_rejoins_after(checkpoint, tmp_path):
    """The last stage of chain 0 is reached only through a relay (it advertises the relay's
    address); SIGSTOP of the relay stalls that chain's data path, while the stage itself runs
    and heartbeats. Its probe through the stalled relay fails; after SIGCONT it passes again."""
    port, cluster_port, relay_port = free_port(), free_port(), free_port()
    logs = (tmp_path / "coordinator.log").open("w")
    procs: list[subprocess.Popen[bytes]] = []
    stages: list[StageProcess] = []

    def spawn(*args: str) -> subprocess.Popen[bytes]:
        procs.append(subprocess.Popen([sys.executable, "-m", *args], stdout=logs, stderr=subprocess.STDOUT))
        return procs[-1]

    try:
        spawn(
            "layerline", "coordinator", "--model", str(checkpoint),
            "--port", str(port), "--cluster-port", str(cluster_port),
        )  # fmt: skip
        member = ("--coordinator", f"127.0.0.1:{cluster_port}", "--kv-memory", "4M")
        stages.append(StageProcess(checkpoint, "0:2", *member, log_dir=tmp_path))
        behind = StageProcess(checkpoint, "2:4", *member, "--advertise", f"127.0.0.1:{relay_port}", log_dir=tmp_path)
        stages.append(behind)
        relay = spawn("layerline.bench.relay", "127.0.0.1", f"{relay_port}:127.0.0.1:{behind.port}:0")
        stages += [StageProcess(checkpoint, layers, *member, log_dir=tmp_path) for layers in ("0:2", "2:4")]
        address = f"127.0.0.1:{port}"
        _wait_for_chains(address, 2)
        reference = asyncio.run(_streams(address, PROMPTS, 48))
        stalled_at: list[float] = []

        def maybe_stall(stream: int, tokens: int) -> None:
            if not stalled_at and tokens >= 8:
                relay.send_signal(signal.SIGSTOP)
                stalled_at.append(time.monotonic())

        faulty = asyncio.run(_streams(address, PROMPTS, 48, on_token=maybe_stall))
        with Client(address) as client:
            during = client.cluster()
        relay.send_signal(signal.SIGCONT)
        rejoined = _wait_for_chains(address, 2)
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
        for s in stages:
            s.stop()
        for p in procs:
            p.terminate()
            p.wait(20)
    assert stalled_at
    assert faulty == reference
    assert during.stalls >= 1 and len(during.chains) == 1
    heard = {w.address: w.seconds_since_heartbeat for w in during.workers}
    assert heard[f"127.0.0.1:{relay_port}"] < HEARTBEAT_EXPIRY  # the stage behind the relay kept its heartbeats
    print(f"longest gap after the stall: {during.max_failover_gap_seconds:.2f}s")
    assert during.max_failover_gap_seconds < HEARTBEAT_EXPIRY
    assert len(rejoined.chains) == 2


def _wait_for_chains(address: str, n: int, timeout: float = 90.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    with Client(address) as client:
        while True:
            try:
                status = client.cluster(timeout=2)
                if len(status.chains) >= n:
                    return status
            except Exception:
                if time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} formed {len(status.chains)} chain(s), not {n}, in {timeout:.0f}s")
            time.sleep(0.2)


@pytest.mark.timeout(300)
def test_a_chain_short_of_kv_preempts_and_recomputes_and_every_request_completes_identically(checkpoint, tmp_path):
    prompts = [f"{i:02d} " + "a long document about foxes and dogs, " * 8 + f"question {i}?" for i in range(16)]
    # 184 KiB of KV on each stage: 736 positions of this model, 46 blocks of 16; a request takes 21
    # blocks to start (its ~320 prompt tokens and the next) and 25 once it has its 80 tokens
    cluster = _tiny_cluster(checkpoint, tmp_path, kv_memory="184K", coordinator_args=("--no-prefix-sharing",))
    try:
        with cluster.client() as client:
            workers = client.cluster().workers
            alone = [asyncio.run(_streams(cluster.address, [p], 80, first=i))[0] for i, p in enumerate(prompts)]
            before = client.cluster().preemptions
            together = asyncio.run(_streams(cluster.address, prompts, 80))
            after = client.cluster().preemptions
    finally:
        cluster.stop()
    assert [w.load.kv_blocks_total for w in workers] == [46, 46]
    assert all(len(p) + 1 >= 300 for p in prompts)
    print("tokens per answer:", sorted(len(t) for t in together))
    assert together == alone
    assert before == 0 and after > 0
