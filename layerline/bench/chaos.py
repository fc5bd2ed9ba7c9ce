"""`layerline bench chaos`: a cluster under `up` keeps every request while its workers die.

Starts `layerline up --replicas 2 --stages 2` as a user would (its own process, supervising its
workers), runs a fixed set of greedy and seeded requests once without faults for their reference
tokens, then keeps `streams` of them running for `duration` seconds while a driver SIGKILLs a
random stage worker `kills` times and SIGSTOPs one for `stop_seconds`, each fault once the
cluster is whole again (every worker SERVING, every chain formed). Every request must come back
with exactly its reference tokens; a token that differs, is missing or is extra counts as lost.
The report also gives the longest gap a client saw between two tokens of a stream, and at the
end the workers SERVING once `up` has brought back what was killed.

Knows nothing of the coordinator's or the stages' internals: it sees what a client and an
operator see (the SDK, ClusterStatus, process ids, signals).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from layerline.client import AsyncClient, ClusterStatus, LayerlineError

REPLICAS, STAGES = 2, 2
Sampling = dict[str, float | int]  # the SDK's sampling options of one request


@dataclass(frozen=True)
class ChaosPlan:
    model: str  # checkpoint directory or known name
    port: int  # the coordinator's
    run_dir: Path  # up's output and its processes' logs
    duration: float = 60.0  # seconds of load under faults
    streams: int = 24  # requests in flight at once
    new_tokens: int = 32  # per request
    kills: int = 3  # SIGKILLs of a random stage worker
    stop_seconds: float = 10.0  # one stage worker SIGSTOPped this long (0: none)
    seed: int = 0  # of the driver's choices
    log: Callable[[str], None] = print


@dataclass
class ChaosReport:
    requests: int = 0  # started under faults
    completed: int = 0  # came back whole, with exactly their reference tokens
    failed: int = 0  # raised an error to the client
    tokens_lost: int = 0  # reference tokens not delivered as they are, and tokens delivered beyond them
    longest_gap_s: float = 0.0  # between two tokens of one stream, as the client saw it
    longest_first_token_s: float = 0.0  # from a request's start to its first token
    failovers: int = 0  # as the coordinator counts them
    stalls: int = 0
    preemptions: int = 0
    coordinator_max_gap_s: float = 0.0  # the coordinator's longest gap from a failure to the next token
    faults: list[str] = field(default_factory=list)
    serving_at_end: int = 0  # workers SERVING once `up` brought back what was killed
    chains_at_end: int = 0
    errors: list[str] = field(default_factory=list)  # the first few

    def passed(self) -> bool:
        return (
            self.tokens_lost == 0
            and self.failed == 0
            and self.completed == self.requests
            and self.serving_at_end == REPLICAS * STAGES
        )

    def lines(self) -> list[str]:
        return [
            f"requests completed: {self.completed} of {self.requests} ({self.failed} failed)",
            f"tokens lost: {self.tokens_lost}",
            f"longest gap a client saw: {self.longest_gap_s:.2f}s between tokens, "
            f"{self.longest_first_token_s:.2f}s to a first token",
            f"coordinator: {self.failovers} failover(s), {self.stalls} stalled chain(s), "
            f"{self.preemptions} preemption(s), longest failover gap {self.coordinator_max_gap_s:.2f}s",
            f"faults: {'; '.join(self.faults)}",
            f"at the end: {self.serving_at_end} worker(s) SERVING in {self.chains_at_end} chain(s)",
            *(f"error: {e}" for e in self.errors),
        ]

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _requests(n: int) -> list[tuple[str, dict[str, float | int]]]:
    """`n` distinct requests: even ones greedy, odd ones sampled under a seed."""
    out: list[tuple[str, dict[str, float | int]]] = []
    for i in range(n):
        prompt = f"Story {i + 1}. Once upon a time, in a village by the sea, there lived"
        out.append((prompt, {"temperature": 0.8, "seed": 7000 + i} if i % 2 else {"temperature": 0.0}))
    return out


class _Up:
    """`python -m layerline up --replicas 2 --stages 2` in its own process."""

    def __init__(self, plan: ChaosPlan) -> None:
        plan.run_dir.mkdir(parents=True, exist_ok=True)
        self.out = plan.run_dir / "up.out"
        self.err = plan.run_dir / "up.err"
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "layerline", "up", "--model", plan.model, "--port", str(plan.port)),
                    *("--replicas", str(REPLICAS), "--stages", str(STAGES)),
                ],
                stdout=out,
                stderr=err,
                env={**os.environ, "TMPDIR": str(plan.run_dir)},
            )

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"layerline up exited with {self.proc.returncode}:\n{self.err.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _whole(client: AsyncClient, up: _Up, timeout: float) -> ClusterStatus:
    """The status once every worker is SERVING and every chain formed; TimeoutError past `timeout`."""
    deadline = time.monotonic() + timeout
    status: ClusterStatus | None = None
    while time.monotonic() < deadline:
        up.check()
        try:
            status = await client.cluster(timeout=2)
        except LayerlineError:
            status = None
        if status is not None and _serving(status) == REPLICAS * STAGES and len(status.chains) == REPLICAS:
            return status
        await asyncio.sleep(0.2)
    raise TimeoutError(f"the cluster was not whole within {timeout:.0f}s: {status}")


def _serving(status: ClusterStatus) -> int:
    return sum(1 for w in status.workers if w.state == "SERVING")


async def _one(
    client: AsyncClient, prompt: str, sampling: dict[str, float | int], n: int
) -> tuple[list[int], float, float]:
    """The tokens of one streamed request, its longest gap between tokens and its first token's wait."""
    ids: list[int] = []
    started = last = time.monotonic()
    gap = first = 0.0
    async for chunk in client.stream(prompt, max_tokens=n, **sampling):  # type: ignore[arg-type]
        now = time.monotonic()
        if chunk.token_ids:
            if ids:
                gap = max(gap, now - last)
            else:
                first = now - started
            last = now
        ids += chunk.token_ids
    return ids, gap, first


def _lost(got: list[int], want: list[int]) -> int:
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return (len(want) - same) + max(0, len(got) - same)


class _Soak:
    """The load and the faults of one run, on one client."""

    def __init__(self, plan: ChaosPlan, up: _Up, client: AsyncClient) -> None:
        self.plan, self.up, self.client = plan, up, client
        self.rng = random.Random(plan.seed)
        self.report = ChaosReport()
        self.requests = _requests(2 * plan.streams)
        self.want: list[list[int]] = []
        self.deadline = 0.0
        self._turn = 0

    async def references(self) -> None:
        limit = asyncio.Semaphore(self.plan.streams)

        async def one(prompt: str, sampling: Sampling) -> list[int]:
            async with limit:
                return (await _one(self.client, prompt, sampling, self.plan.new_tokens))[0]

        self.want = list(await asyncio.gather(*(one(p, s) for p, s in self.requests)))

    async def stream_until_deadline(self) -> None:
        report = self.report
        while time.monotonic() < self.deadline:
            i, self._turn = self._turn % len(self.requests), self._turn + 1
            report.requests += 1
            try:
                got, gap, first = await _one(self.client, *self.requests[i], self.plan.new_tokens)
            except LayerlineError as err:
                report.failed += 1
                report.tokens_lost += len(self.want[i])
                if len(report.errors) < 5:
                    report.errors.append(f"request {i}: {err}")
                continue
            report.longest_gap_s = max(report.longest_gap_s, gap)
            report.longest_first_token_s = max(report.longest_first_token_s, first)
            lost = _lost(got, self.want[i])
            report.tokens_lost += lost
            report.completed += lost == 0

    async def drive(self) -> None:
        plan = self.plan
        faults = ["kill"] * plan.kills + (["stop"] if plan.stop_seconds > 0 else [])
        self.rng.shuffle(faults)
        for k, fault in enumerate(faults):
            at = self.deadline - plan.duration + plan.duration * (k + 0.5) / len(faults)
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            status = await _whole(self.client, self.up, 180)  # one fault at a time: the other chain carries the load
            victim = self.rng.choice([w for w in status.workers if w.state == "SERVING"])
            elapsed = plan.duration - (self.deadline - time.monotonic())
            if fault == "kill":
                os.kill(victim.pid, signal.SIGKILL)
                self.report.faults.append(f"SIGKILL {victim.address} at {elapsed:.0f}s")
                plan.log(self.report.faults[-1])
                continue
            os.kill(victim.pid, signal.SIGSTOP)
            self.report.faults.append(f"SIGSTOP {victim.address} for {plan.stop_seconds:.0f}s at {elapsed:.0f}s")
            plan.log(self.report.faults[-1])
            try:
                await asyncio.sleep(plan.stop_seconds)
            finally:
                os.kill(victim.pid, signal.SIGCONT)

    async def run(self) -> ChaosReport:
        plan, report = self.plan, self.report
        await _whole(self.client, self.up, 300)
        plan.log(f"reference: {len(self.requests)} requests without faults")
        await self.references()
        plan.log(f"chaos: {plan.streams} streams for {plan.duration:.0f}s")
        self.deadline = time.monotonic() + plan.duration
        await asyncio.gather(self.drive(), *(self.stream_until_deadline() for _ in range(plan.streams)))
        end = await _whole(self.client, self.up, 300)
        report.serving_at_end, report.chains_at_end = _serving(end), len(end.chains)
        report.failovers, report.stalls, report.preemptions = end.failovers, end.stalls, end.preemptions
        report.coordinator_max_gap_s = end.max_failover_gap_seconds
        return report


async def _chaos(plan: ChaosPlan, up: _Up) -> ChaosReport:
    async with AsyncClient(f"127.0.0.1:{plan.port}") as client:
        return await _Soak(plan, up, client).run()


def run_chaos(plan: ChaosPlan) -> ChaosReport:
    """Start `up`, run the soak, stop `up`; the report says what the clients saw."""
    up = _Up(plan)
    try:
        return asyncio.run(_chaos(plan, up))
    finally:
        up.stop()
