"""The floors under `layerline bench`'s figures of a split: a bare gRPC relay of the model's matmuls.

Owns `measure_hop_floor`. It starts bare relay stages as OS processes on this machine: one holding
all of a model's layers, and two holding them split as `layerline up --stages 2` splits them. It
drives steps of one token (or of `rows` tokens, one a sequence) through the 1-stage relay and the
2-stage one, the two taking turns every BLOCK steps within each round, so that the drift of a
shared machine (20-40% between rounds of a minute) falls on both alike. The difference of their
median times between steps is what one more hop costs on this machine with none of layerline's
own work in it: no scheduler, KV cache, attention, sampling, checks or telemetry, only grpc.aio
messages and the weights' matmuls; their ratio at 32 rows is the most 2 stages taking turns on
the cores could keep of 1 stage's tokens a second.

A relay stage is a grpc.aio server. Its step runs each of its layers' matmuls (fused qkv, o,
fused gate/up, down, with SiLU) on random weights (float32, or `dtype`; at several rows a step on
oneDNN's packed layout, as a stage's), on the torch threads the measured chain's steps take
(`threads`), inline on the event loop, with a stage's OpenMP environment. It
sends the hidden state, encoded by the codec, to the next stage; the last stage applies the LM
head and answers each row's argmax token on a Results stream, as layerline's last stage answers
the coordinator. Weights are seeded by layer index, so both relays compute the same function and
return the same tokens.

Knows a model by its config's shapes only: no checkpoint, tokenizer or coordinator.
"""

from __future__ import annotations

import argparse
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

from layerline.launcher import split_layers
from layerline.shared.model_config import ModelConfig
from layerline.shared.rpc import listen, server_options
from layerline.shared.settings import DTYPES
from layerline.stage_worker.settings import openmp_defaults

SERVICE = "layerline.HopFloor"
READY_TIMEOUT_S = 300.0  # a relay stage builds its random weights before it listens
TOKEN_TIMEOUT_S = 60.0  # a token's way through a relay; past it the measurement fails, never hangs
BLOCK = 8  # steps through one relay before the other takes its turn
EMBEDDING_SEED, HEAD_SEED = 2**31 - 1, 2**31 - 2  # layer n's four weights take seeds 4n .. 4n + 3


def _raw(b: bytes) -> bytes:
    return b


def _message(tokens: list[int]) -> bytes:
    """A step's tokens, one a row, as the driver sends them and the last stage answers them."""
    return b"".join(t.to_bytes(4, "little") for t in tokens)


def _tokens(message: bytes) -> list[int]:
    return [int.from_bytes(message[i : i + 4], "little") for i in range(0, len(message), 4)]


@dataclass(frozen=True)
class Shapes:
    """The matmul shapes of a Llama-family decoder (global sizes: the relay has no tensor parallelism)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    qkv_width: int  # (num_heads + 2 * num_kv_heads) * head_dim
    o_width: int  # num_heads * head_dim

    @classmethod
    def of(cls, c: ModelConfig) -> Shapes:
        """From a model's config, as a stage reads it."""
        return cls(
            c.vocab_size,
            c.hidden_size,
            c.intermediate_size,
            c.num_layers,
            (c.num_heads + 2 * c.num_kv_heads) * c.head_dim,
            c.num_heads * c.head_dim,
        )


async def _serve_stage(
    port: int,
    shapes: Shapes,
    start: int,
    end: int,
    next_address: str | None,
    *,
    threads: int = 1,
    packed: bool = False,
    dtype: str = "float32",
) -> None:
    import torch

    from layerline.protos.v1 import tensor_pb2
    from layerline.stage_worker.codec import CodecLimits, decode, encode

    torch.set_num_threads(threads)
    F = torch.nn.functional
    h, i = shapes.hidden_size, shapes.intermediate_size

    from layerline.stage_worker.layouts import can_pack

    kind = getattr(torch, dtype)
    packed = packed and can_pack(kind, "cpu")  # where oneDNN has no kernel for the dtype, torch's plain product

    def weight(seed: int, rows: int, cols: int) -> torch.Tensor:
        w = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * cols**-0.5).to(kind)
        return torch.ops.mkldnn._reorder_linear_weight(w, None) if packed else w

    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if packed:  # oneDNN's kernel on its own layout, as a stage's packed weights take several rows
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        return F.linear(x, w)

    layers = [
        (
            weight(4 * n, shapes.qkv_width, h),
            weight(4 * n + 1, h, shapes.o_width),
            weight(4 * n + 2, 2 * i, h),
            weight(4 * n + 3, h, i),
        )
        for n in range(start, end)
    ]
    embedding = (  # a lookup, never a product: plain
        (torch.randn(shapes.vocab_size, h, generator=torch.Generator().manual_seed(EMBEDDING_SEED)) * h**-0.5).to(kind)
        if start == 0
        else None
    )
    head = weight(HEAD_SEED, shapes.vocab_size, h) if end == shapes.num_layers else None
    limits = CodecLimits()
    answers: dict[str, asyncio.Queue[bytes]] = {"now": asyncio.Queue()}  # the newest subscriber's
    downstream: list[grpc.aio.StreamStreamCall] = []  # to the next stage, opened by the first step

    @torch.inference_mode()
    def compute(x: torch.Tensor) -> torch.Tensor:  # [rows, hidden]
        for qkv, o, gate_up, down in layers:
            attn = linear(x, qkv)[:, : shapes.o_width]  # [rows, o_width]: a stand-in for attention's output
            x = x + linear(attn.contiguous(), o)
            gate, up = linear(x, gate_up).chunk(2, dim=-1)  # each [rows, intermediate]
            x = x + linear(F.silu(gate) * up, down)
        return x

    async def step(requests, context):
        async for message in requests:
            if embedding is not None:
                x = embedding[_tokens(message)]  # [rows, hidden]
            else:
                x = decode(tensor_pb2.Tensor.FromString(message), limits=limits)
            x = compute(x)
            if head is None:
                assert next_address is not None
                if not downstream:  # every stage listens by now: the driver waited for them all
                    channel = grpc.aio.insecure_channel(next_address)
                    downstream.append(
                        channel.stream_stream(f"/{SERVICE}/Step", request_serializer=_raw, response_deserializer=_raw)(
                            wait_for_ready=True  # type: ignore[call-arg]  # grpc-stubs lack grpc.aio's iterator-less call
                        )
                    )
                await downstream[0].write(encode(x).SerializeToString())
            else:
                answers["now"].put_nowait(_message(linear(x, head).argmax(-1).tolist()))
        yield b""

    async def results(request, context):
        queue = answers["now"] = asyncio.Queue()  # replaces the last round's subscriber
        await context.send_initial_metadata(())  # the driver knows it is subscribed
        while True:
            yield await queue.get()

    server = grpc.aio.server(options=server_options())
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE,
                {
                    "Step": grpc.stream_stream_rpc_method_handler(step, _raw, _raw),
                    "Results": grpc.unary_stream_rpc_method_handler(results, _raw, _raw),
                },
            ),
        )
    )
    listen(server, f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


class _Relay:
    """A driver's streams into one relay (its first stage) and out of it (its last): one step at a time."""

    def __init__(self, first: str, last: str) -> None:
        self.first, self.last = first, last
        self._head = grpc.aio.insecure_channel(first)
        self._tail = grpc.aio.insecure_channel(last)
        self._opened = False

    async def open(self) -> None:
        self._results = self._tail.unary_stream(
            f"/{SERVICE}/Results", request_serializer=_raw, response_deserializer=_raw
        )(b"")
        await asyncio.wait_for(self._results.initial_metadata(), TOKEN_TIMEOUT_S)
        self._steps = self._head.stream_stream(
            f"/{SERVICE}/Step", request_serializer=_raw, response_deserializer=_raw
        )()  # type: ignore[call-arg]
        self._opened = True

    async def step(self, tokens: list[int]) -> tuple[list[int], float]:
        """Send a step's tokens, await the next ones: (them, the seconds between)."""
        started = time.perf_counter()
        await self._steps.write(_message(tokens))
        try:
            answer = await asyncio.wait_for(self._results.read(), TOKEN_TIMEOUT_S)
        except TimeoutError:
            raise TimeoutError(
                f"the bare relay {self.first} .. {self.last} returned no step within {TOKEN_TIMEOUT_S:.0f} s"
            ) from None
        if answer is grpc.aio.EOF:  # type: ignore[attr-defined]  # grpc-stubs lack it
            raise RuntimeError(f"the bare relay's results stream from {self.last} ended")
        return _tokens(answer), time.perf_counter() - started  # type: ignore[arg-type]

    async def close(self) -> None:
        if self._opened:
            self._results.cancel()
            await self._steps.done_writing()
        await self._head.close(None)
        await self._tail.close(None)


async def _round(one: _Relay, two: _Relay, *, tokens: int, rows: int, reverse: bool) -> tuple[float, float]:
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
                for i in range(block, min(block + BLOCK, tokens)):
                    steps[relay], gap = await relay.step(steps[relay])
                    out[relay].append(steps[relay])
                    gaps[relay].append((i > block, gap))
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
    one: str, first: str, last: str, *, rounds: int, tokens: int, rows: int, log: Callable[[str], None]
) -> tuple[list[float], list[float]]:
    """Rounds on one event loop, the relays taking turns within each (see _round): each relay's
    median gap per round."""
    one_gaps: list[float] = []
    two_gaps: list[float] = []
    for r in range(rounds):
        one_gap, two_gap = await _round(
            _Relay(one, one), _Relay(first, last), tokens=tokens, rows=rows, reverse=r % 2 == 1
        )
        one_gaps.append(one_gap)
        two_gaps.append(two_gap)
        log(
            f"hop floor round {r + 1}/{rounds}, {rows} row{'s' if rows > 1 else ''}: bare relay, a step every "
            f"{one_gap:.2f} ms on 1 stage, {two_gap:.2f} ms on 2: {two_gap - one_gap:.2f} ms a hop"
        )
    return one_gaps, two_gaps


@dataclass(frozen=True)
class HopFloor:
    one_stage_gap_ms: float  # medians over rounds of each round's median time between tokens
    two_stages_gap_ms: float
    added_ms_per_hop: float  # the second minus the first
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
    env: dict[str, str] | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> HopFloor:
    """Start the relays (ports `port`..`port + 2`), measure, stop them; raise if their tokens differ.

    `ranges`: the 2-stage relay's split (default: `split_layers` by the bytes of the head);
    `threads`: each relay stage's torch threads, as the measured chain's steps take them; `rows`:
    sequences a step (each relay stage's steps take them all at once, as a chain's stages take
    turns; above one, on oneDNN's packed weights where it packs `dtype`); `dtype`: the weights'
    and activations'; `env`: added to each relay stage's environment (a local chain's stage environment:
    its threads and OpenMP binding; the OpenMP wait policy is a stage's unless it names one).
    """
    shapes = Shapes.of(config)
    ranges = ranges or split_layers(shapes.num_layers, 2, head_weight=config.head_weight)
    plan = [
        (port, 0, shapes.num_layers, None),
        (port + 1, *ranges[0], f"127.0.0.1:{port + 2}"),
        (port + 2, *ranges[1], None),
    ]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "layerline.bench.hop_floor",
                "--port",
                str(p),
                "--layers",
                f"{a}:{b}",
                "--shapes",
                json.dumps(asdict(shapes)),
                "--threads",
                str(threads),
                *(["--packed"] if rows > 1 else []),
                "--dtype",
                dtype,
                *(["--next", n] if n else []),
            ],
            env={**os.environ, **(env or {})},
        )
        for p, a, b, n in plan
    ]
    try:
        for proc, (p, *_) in zip(procs, plan):
            _wait_listening(proc, p)
        addresses = (f"127.0.0.1:{p}" for p, *_ in plan)
        one, two = asyncio.run(_rounds(*addresses, rounds=rounds, tokens=tokens, rows=rows, log=log))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
    a, b = statistics.median(one), statistics.median(two)
    within = [x / y for x, y in zip(one, two)]  # each round's 2 stages over 1, in tokens a second
    return HopFloor(a, b, b - a, ranges, rounds, tokens, threads, rows, dtype, statistics.median(within), within)


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m layerline.bench.hop_floor", description="One bare relay stage (started by measure_hop_floor)."
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--layers", required=True, metavar="START:END")
    parser.add_argument("--shapes", required=True, metavar="JSON")
    parser.add_argument("--next", metavar="ADDR", help="the next stage; none on the last")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and activations (default: float32)")
    parser.add_argument(
        "--packed", action="store_true", help="products on oneDNN's packed weights (a stage's, for several rows)"
    )
    args = parser.parse_args(argv)
    start, end = (int(v) for v in args.layers.split(":"))
    openmp_defaults(os.environ)  # a stage's OpenMP wait policy, before torch is imported
    shapes = Shapes(**json.loads(args.shapes))
    asyncio.run(
        _serve_stage(
            args.port, shapes, start, end, args.next, threads=args.threads, packed=args.packed, dtype=args.dtype
        )
    )


if __name__ == "__main__":
    main()
