"""The floors under `layerline bench`'s figures of a split: a bare gRPC relay of the model's matmuls.

Owns `measure_hop_floor`. It starts bare relay stages as OS processes on this machine: one holding
all of a model's layers, and two holding them split as `layerline up --stages 2` splits them. It
runs steps of one token (or of `rows` tokens, one a sequence) through the 1-stage relay and the
2-stage one, the two taking turns every BLOCK steps within each round, so that the drift of a
shared machine (20-40% between rounds of a minute) falls on both alike. Each round's difference of
their median times between steps, the median of those over rounds, is what one more hop costs on
this machine with none of layerline's own work in it: no scheduler, KV cache, attention, sampling,
checks or telemetry, only grpc.aio messages and the weights' matmuls; their ratio is the most 2
stages could keep of 1 stage's tokens a second. Two ways to step, as layerline steps: the driver
sends every step and awaits its tokens (a batch's steps, each scheduled by the coordinator), or, on
a ring, the driver sends a block's first step and the last stage sends each step's tokens to the
first stage, which goes on from them (a lone stream's, whose first stage runs its next step ahead):
a token then crosses each hop of the chain once and no driver lies on its path.
A relay stage is a process of its own (relay_stage.py): the model's matmuls on random weights
seeded by layer index, in a stage's OpenMP environment, so both relays compute the same function
and return the same tokens; at several rows a step, and on a ring, on packed weights (oneDNN's, or
AMX tiles or FMA blocks where they serve), as a stage's are (a lone row's relay on torch's plain
products, as the bench ran it until the thirty-first session, computed a bfloat16 token in 21 ms
here against 10 packed, and a float32 one in 23.5 against 19.4).

Knows a model by its config's shapes only: no checkpoint, tokenizer or coordinator.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import grpc

from layerline.bench.relay_stage import SERVICE, Shapes, decode_tokens, encode_tokens, raw_bytes
from layerline.bench.rounds import paired, paired_differences
from layerline.launcher import split_layers
from layerline.shared.model_config import ModelConfig

READY_TIMEOUT_S = 300.0  # a relay stage builds its random weights before it listens
TOKEN_TIMEOUT_S = 60.0  # a token's way through a relay; past it the measurement fails, never hangs
BLOCK = 8  # steps through one relay before the other takes its turn


class _Relay:
    """A driver's streams into one relay (its first stage) and out of it (its last): a block of steps at a time."""

    def __init__(self, first: str, last: str) -> None:
        self.first, self.last = first, last
        self._head = grpc.aio.insecure_channel(first)
        self._tail = grpc.aio.insecure_channel(last)
        self._opened = False

    async def open(self) -> None:
        self._results = self._tail.unary_stream(
            f"/{SERVICE}/Results", request_serializer=raw_bytes, response_deserializer=raw_bytes
        )(b"")
        await asyncio.wait_for(self._results.initial_metadata(), TOKEN_TIMEOUT_S)
        self._steps = self._head.stream_stream(
            f"/{SERVICE}/Step", request_serializer=raw_bytes, response_deserializer=raw_bytes
        )()  # type: ignore[call-arg]
        self._opened = True

    async def block(self, tokens: list[int], steps: int, *, ring: bool) -> list[tuple[list[int], float]]:
        """`steps` steps from `tokens`: each step's tokens and the seconds from the last step's (for
        the first, from the driver's message). Off a ring the driver sends each step's tokens back
        itself; on one it sends the first and the stages go on from their own answers."""
        out: list[tuple[list[int], float]] = []
        started = time.perf_counter()
        for left in range(steps - 1, -1, -1):
            if not ring or left == steps - 1:
                await self._steps.write(encode_tokens(tokens, left if ring else 0))
            tokens = await self._answer()
            now = time.perf_counter()
            out.append((tokens, now - started))
            started = now
        return out

    async def _answer(self) -> list[int]:
        try:
            answer = await asyncio.wait_for(self._results.read(), TOKEN_TIMEOUT_S)
        except TimeoutError:
            raise TimeoutError(
                f"the bare relay {self.first} .. {self.last} returned no step within {TOKEN_TIMEOUT_S:.0f} s"
            ) from None
        if answer is grpc.aio.EOF:  # type: ignore[attr-defined]  # grpc-stubs lack it
            raise RuntimeError(f"the bare relay's results stream from {self.last} ended")
        return decode_tokens(answer)[0]  # type: ignore[arg-type]

    async def close(self) -> None:
        if self._opened:
            self._results.cancel()
            await self._steps.done_writing()
        await self._head.close(None)
        await self._tail.close(None)


async def _round(one: _Relay, two: _Relay, *, tokens: int, rows: int, reverse: bool, ring: bool) -> tuple[float, float]:
    """`tokens` steps through each relay, taking turns every BLOCK steps (the one that starts
    alternating by round): each relay's median gap in ms, of every block's steps after its first
    (the first pays for the threads that slept through the other relay's block). Raises if the
    two relays' tokens differ."""
    relays = (two, one) if reverse else (one, two)
    steps = {relay: [1 + row for row in range(rows)] for relay in relays}  # each row its own sequence
    out: dict[_Relay, list[list[int]]] = {relay: [] for relay in relays}
    gaps: dict[_Relay, list[tuple[bool, float]]] = {relay: [] for relay in relays}  # (warm, seconds)
    try:
        for relay in relays:
            await relay.open()
        for block in range(0, tokens, BLOCK):
            for relay in relays:
                done = await relay.block(steps[relay], min(BLOCK, tokens - block), ring=ring)
                for i, (answer, gap) in enumerate(done):
                    out[relay].append(answer)
                    gaps[relay].append((i > 0, gap))
                steps[relay] = done[-1][0]
    finally:
        for relay in relays:
            await relay.close()
    if out[one] != out[two]:
        raise RuntimeError("the 1-stage and 2-stage relays returned different tokens")

    def median_ms(relay: _Relay) -> float:  # of the warm steps (of all, when a round is one step)
        warm = [gap for is_warm, gap in gaps[relay] if is_warm] or [gap for _, gap in gaps[relay]]
        return 1000 * statistics.median(warm)

    return median_ms(one), median_ms(two)


async def _rounds(
    one: str, first: str, last: str, *, rounds: int, tokens: int, rows: int, ring: bool, log: Callable[[str], None]
) -> tuple[list[float], list[float]]:
    """Rounds on one event loop, the relays taking turns within each (see _round): each relay's
    median gap per round."""
    one_gaps: list[float] = []
    two_gaps: list[float] = []
    for r in range(rounds):
        one_gap, two_gap = await _round(
            _Relay(one, one), _Relay(first, last), tokens=tokens, rows=rows, reverse=r % 2 == 1, ring=ring
        )
        one_gaps.append(one_gap)
        two_gaps.append(two_gap)
        log(
            f"hop floor round {r + 1}/{rounds}, {rows} row{'s' if rows > 1 else ''}: bare relay"
            f"{' ring' if ring else ''}, a step every "
            f"{one_gap:.2f} ms on 1 stage, {two_gap:.2f} ms on 2: {two_gap - one_gap:.2f} ms a hop"
        )
    return one_gaps, two_gaps


@dataclass(frozen=True)
class HopFloor:
    one_stage_gap_ms: float  # medians over rounds of each round's median time between tokens
    two_stages_gap_ms: float
    # The second minus the first: the median of the rounds' differences (each round's 2-stage gap
    # minus its 1-stage gap, the two measured taking turns), not the difference of the medians above.
    added_ms_per_hop: float
    layer_ranges: list[tuple[int, int]]  # of the two stages
    rounds: int
    tokens: int  # per stream and round
    threads: int = 1  # each relay stage's torch threads
    rows: int = 1  # a step's rows (sequences)
    dtype: str = "float32"  # the weights' and the activations'
    # The 2-stage relay's tokens a second over the 1-stage one's: the median of the rounds' (each
    # round's 1-stage gap over its 2-stage gap, measured taking turns).
    two_vs_one_stage: float = 1.0
    two_vs_one_stage_rounds: list[float] = field(default_factory=list)
    ring: bool = False  # the last stage fed the first its tokens (a lone stream run ahead), not the driver
    added_ms_per_hop_rounds: list[float] = field(default_factory=list)  # each round's difference


def measure_hop_floor(
    config: ModelConfig,
    *,
    rounds: int = 5,
    tokens: int = 64,
    port: int = 7190,
    ranges: list[tuple[int, int]] | None = None,
    threads: int = 1,
    rows: int = 1,
    dtype: str = "float32",
    ring: bool = False,
    env: dict[str, str] | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> HopFloor:
    """Start the relays (ports `port`..`port + 2`), measure, stop them; raise if their tokens differ.

    `ranges`: the 2-stage relay's split (default: `split_layers` by the bytes of the head);
    `threads`: each relay stage's torch threads, as the measured chain's steps take them; `rows`:
    sequences a step (each relay stage's steps take them all at once, as a chain's stages take
    turns; above one, on packed weights where `dtype` packs, as on a ring); `dtype`: the weights'
    and activations'; `ring`: each relay's last stage sends its tokens to its first stage, which
    goes on from them, as a lone stream's first stage runs its next step ahead (otherwise the
    driver sends each step, as the coordinator sends a batch's); `env`: added to each relay stage's
    environment (a local chain's stage environment: its threads and OpenMP binding; the OpenMP wait
    policy is a stage's unless it names one).
    """
    shapes = Shapes.of(config)
    ranges = ranges or split_layers(shapes.num_layers, 2, head_weight=config.head_weight)
    plan = [  # (port, first layer, end, the next stage, the ring's first stage)
        (port, 0, shapes.num_layers, None, f"127.0.0.1:{port}"),
        (port + 1, *ranges[0], f"127.0.0.1:{port + 2}", None),
        (port + 2, *ranges[1], None, f"127.0.0.1:{port + 1}"),
    ]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "layerline.bench.relay_stage",
                "--port",
                str(p),
                "--layers",
                f"{a}:{b}",
                "--shapes",
                json.dumps(asdict(shapes)),
                "--threads",
                str(threads),
                *(["--packed"] if rows > 1 or ring else []),
                "--dtype",
                dtype,
                *(["--next", n] if n else []),
                *(["--ring", first] if ring and first else []),
            ],
            env={**os.environ, **(env or {})},
        )
        for p, a, b, n, first in plan
    ]
    try:
        for proc, (p, *_) in zip(procs, plan):
            _wait_listening(proc, p)
        addresses = (f"127.0.0.1:{p}" for p, *_ in plan)
        one, two = asyncio.run(_rounds(*addresses, rounds=rounds, tokens=tokens, rows=rows, ring=ring, log=log))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
    a, b = statistics.median(one), statistics.median(two)
    within = paired(one, two)  # each round's 2 stages over 1, in tokens a second
    hops = paired_differences(two, one)  # each round's extra hop, ms
    return HopFloor(
        one_stage_gap_ms=a,
        two_stages_gap_ms=b,
        added_ms_per_hop=statistics.median(hops),
        layer_ranges=ranges,
        rounds=rounds,
        tokens=tokens,
        threads=threads,
        rows=rows,
        dtype=dtype,
        two_vs_one_stage=statistics.median(within),
        two_vs_one_stage_rounds=within,
        ring=ring,
        added_ms_per_hop_rounds=hops,
    )


def _wait_listening(proc: subprocess.Popen[bytes], port: int) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        ready = grpc.channel_ready_future(channel)
        while True:
            try:
                ready.result(timeout=1.0)
                return
            except grpc.FutureTimeoutError:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"the bare relay stage on port {port} exited with code {proc.returncode}"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the bare relay stage on port {port} did not listen within {READY_TIMEOUT_S:.0f} s"
                    ) from None
