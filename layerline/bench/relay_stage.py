"""One bare relay stage: a process of `hop_floor`'s relays (started by `measure_hop_floor`).

Owns the relay's wire (a step's tokens as 4 bytes a row after 4 bytes of steps left,
`encode_tokens`), the matmul shapes of a Llama-family decoder (`Shapes`), a stage's part of the
model (`_Layers`) and the stage's server. A relay stage is a grpc.aio server. Its step runs each of
its layers' matmuls (fused qkv, o, fused gate/up, down, with SiLU) on random weights (float32, or
`--dtype`; with `--packed`, on a stage's packed layouts, as a stage's steps are), on
`--threads` torch threads, inline on the event loop, with a stage's OpenMP environment. It sends
the hidden state, encoded by the codec, to the next stage; the last stage applies the LM head and
answers each row's argmax token on a Results stream, as layerline's last stage answers the
coordinator. Weights are seeded by layer index, so a 1-stage and a 2-stage relay compute the same
function and return the same tokens.

A ring (`--ring`, the first stage's address, given to the last stage) runs a lone stream's steps as
layerline runs it ahead: a step carries how many steps are left, and the last stage sends its
tokens to the first stage itself before it answers the driver, so no driver round trip lies on a
token's path; on a 1-stage ring the stage goes on from its own tokens on a thread of its own (all
its torch work on it) while the event loop answers, as a stage's compute thread runs ahead while
its loop sends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from layerline.shared.model_config import ModelConfig
from layerline.shared.rpc import listen, server_options
from layerline.shared.settings import DTYPES
from layerline.stage_worker.settings import openmp_defaults

if TYPE_CHECKING:
    import torch

SERVICE = "layerline.HopFloor"
EMBEDDING_SEED, HEAD_SEED = 2**31 - 1, 2**31 - 2  # layer n's four weights take seeds 4n .. 4n + 3


def raw_bytes(b: bytes) -> bytes:
    return b


def encode_tokens(tokens: list[int], left: int = 0) -> bytes:
    """A step's tokens, one a row, after the steps a ring is to run after it (`left`; 0 off a ring)."""
    return b"".join(t.to_bytes(4, "little") for t in [left, *tokens])


def decode_tokens(message: bytes) -> tuple[list[int], int]:
    """(tokens, steps left) of `encode_tokens`."""
    left, *tokens = (int.from_bytes(message[i : i + 4], "little") for i in range(0, len(message), 4))
    return tokens, left


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


class _Layers:
    """A relay stage's part of the model: its layers' products, the embedding on the first stage
    and the LM head on the last, on random weights seeded by layer index."""

    def __init__(self, shapes: Shapes, start: int, end: int, *, packed: bool, dtype: str) -> None:
        import torch

        from layerline.stage_worker.layouts import can_pack
        from layerline.stage_worker.tiles import pack, packed_product

        h, i = shapes.hidden_size, shapes.intermediate_size
        kind = getattr(torch, dtype)
        self.packed = packed and can_pack(kind, "cpu")  # where oneDNN has no kernel for the dtype: plain products
        self.o_width = shapes.o_width

        def weight(seed: int, rows: int, cols: int) -> torch.Tensor:
            w = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * cols**-0.5).to(kind)
            return pack(w) if self.packed else w  # as layouts.PackedLinear packs: AMX tiles or FMA blocks

        self.layers = [
            (
                weight(4 * n, shapes.qkv_width, h),
                weight(4 * n + 1, h, shapes.o_width),
                weight(4 * n + 2, 2 * i, h),
                weight(4 * n + 3, h, i),
            )
            for n in range(start, end)
        ]
        self.embedding = (  # a lookup, never a product: plain
            (torch.randn(shapes.vocab_size, h, generator=torch.Generator().manual_seed(EMBEDDING_SEED)) * h**-0.5).to(
                kind
            )
            if start == 0
            else None
        )
        self.head = weight(HEAD_SEED, shapes.vocab_size, h) if end == shapes.num_layers else None
        self._packed_product, self._plain_product = packed_product, torch.nn.functional.linear
        self._silu, self._inference_mode = torch.nn.functional.silu, torch.inference_mode

    def _linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._packed_product(x, w, None) if self.packed else self._plain_product(x, w)

    def compute(self, x: torch.Tensor) -> torch.Tensor:  # [rows, hidden]
        with self._inference_mode():
            for qkv, o, gate_up, down in self.layers:
                attn = self._linear(x, qkv)[:, : self.o_width]  # [rows, o_width]: a stand-in for attention's output
                x = x + self._linear(attn.contiguous(), o)
                gate, up = self._linear(x, gate_up).chunk(2, dim=-1)  # each [rows, intermediate]
                x = x + self._linear(self._silu(gate) * up, down)
            return x

    def tokens(self, x: torch.Tensor) -> list[int]:
        """Each row's argmax token through the LM head (the last stage's)."""
        assert self.head is not None
        return self._linear(x, self.head).argmax(-1).tolist()

    def alone(self, tokens: list[int], left: int, answer: Callable[[list[int]], None]) -> None:
        """A 1-stage ring's steps (on a thread): each goes on from the last one's tokens at once."""
        assert self.embedding is not None
        while True:
            tokens = self.tokens(self.compute(self.embedding[tokens]))
            answer(tokens)
            if left == 0:
                return
            left -= 1


async def _serve_stage(
    port: int, stage: _Layers, *, next_address: str | None, ring: str | None = None, alone: Executor | None = None
) -> None:
    from layerline.protos.v1 import tensor_pb2
    from layerline.stage_worker.codec import CodecLimits, decode, encode

    limits = CodecLimits()
    answers: dict[str, asyncio.Queue[bytes]] = {"now": asyncio.Queue()}  # the newest subscriber's
    streams: dict[str, grpc.aio.StreamStreamCall] = {}  # to the next stage, or the ring's first; opened at first use
    loop = asyncio.get_running_loop()

    def stream_to(address: str) -> grpc.aio.StreamStreamCall:
        if address not in streams:  # every stage listens by now: the driver waited for them all
            streams[address] = grpc.aio.insecure_channel(address).stream_stream(
                f"/{SERVICE}/Step", request_serializer=raw_bytes, response_deserializer=raw_bytes
            )(
                wait_for_ready=True  # type: ignore[call-arg]  # grpc-stubs lack grpc.aio's iterator-less call
            )
        return streams[address]

    def answer_from_thread(queue: asyncio.Queue[bytes]) -> Callable[[list[int]], None]:
        def answer(tokens: list[int]) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, encode_tokens(tokens))

        return answer

    async def step(requests, context):
        async for message in requests:
            if stage.embedding is not None:
                tokens, left = decode_tokens(message)
                if alone is not None:
                    await loop.run_in_executor(alone, stage.alone, tokens, left, answer_from_thread(answers["now"]))
                    continue
                x = stage.embedding[tokens]  # [rows, hidden]
            else:
                left = int.from_bytes(message[:4], "little")
                x = decode(tensor_pb2.Tensor.FromString(message[4:]), limits=limits)
            x = stage.compute(x)
            if stage.head is None:
                assert next_address is not None
                await stream_to(next_address).write(left.to_bytes(4, "little") + encode(x).SerializeToString())
                continue
            tokens = stage.tokens(x)
            if ring is not None and left > 0:  # the first stage's next step, before the driver's answer
                await stream_to(ring).write(encode_tokens(tokens, left - 1))
            answers["now"].put_nowait(encode_tokens(tokens))
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
                    "Step": grpc.stream_stream_rpc_method_handler(step, raw_bytes, raw_bytes),
                    "Results": grpc.unary_stream_rpc_method_handler(results, raw_bytes, raw_bytes),
                },
            ),
        )
    )
    listen(server, f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m layerline.bench.relay_stage", description="One bare relay stage (started by measure_hop_floor)."
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--layers", required=True, metavar="START:END")
    parser.add_argument("--shapes", required=True, metavar="JSON")
    parser.add_argument("--next", metavar="ADDR", help="the next stage; none on the last")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and activations (default: float32)")
    parser.add_argument(
        "--ring",
        metavar="ADDR",
        help="the first stage (the last stage's own on 1 stage): its steps go on from the tokens",
    )
    parser.add_argument(
        "--packed", action="store_true", help="products on a stage's packed weights (oneDNN's, AMX tiles or FMA blocks)"
    )
    args = parser.parse_args(argv)
    start, end = (int(v) for v in args.layers.split(":"))
    openmp_defaults(os.environ)  # a stage's OpenMP wait policy, before torch is imported
    shapes = Shapes(**json.loads(args.shapes))
    # A 1-stage ring computes on a thread while its event loop answers; then every product runs on
    # that thread, weights built there too: a second thread's OpenMP team would slow both (compute.py).
    alone = ThreadPoolExecutor(1) if args.ring and start == 0 and end == shapes.num_layers else None

    def build() -> _Layers:
        import torch

        torch.set_num_threads(args.threads)
        return _Layers(shapes, start, end, packed=args.packed, dtype=args.dtype)

    stage = alone.submit(build).result() if alone is not None else build()
    asyncio.run(_serve_stage(args.port, stage, next_address=args.next, ring=args.ring, alone=alone))


if __name__ == "__main__":
    main()
