"""One bare relay stage: a process of `hop_floor`'s relays (started by `measure_hop_floor`).

Owns the relay's wire (a step's tokens as 4 bytes a row, `message` and `tokens`), the matmul
shapes of a Llama-family decoder (`Shapes`) and the stage's server. A relay stage is a grpc.aio
server. Its step runs each of its layers' matmuls (fused qkv, o, fused gate/up, down, with SiLU)
on random weights (float32, or `--dtype`; with `--packed`, on oneDNN's packed layout, as a
stage's several-row steps are), on `--threads` torch threads, inline on the event loop, with a
stage's OpenMP environment. It sends the hidden state, encoded by the codec, to the next stage;
the last stage applies the LM head and answers each row's argmax token on a Results stream, as
layerline's last stage answers the coordinator. Weights are seeded by layer index, so a 1-stage
and a 2-stage relay compute the same function and return the same tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from dataclasses import dataclass

import grpc

from layerline.shared.model_config import ModelConfig
from layerline.shared.rpc import listen, server_options
from layerline.shared.settings import DTYPES
from layerline.stage_worker.settings import openmp_defaults

SERVICE = "layerline.HopFloor"
EMBEDDING_SEED, HEAD_SEED = 2**31 - 1, 2**31 - 2  # layer n's four weights take seeds 4n .. 4n + 3


def raw_bytes(b: bytes) -> bytes:
    return b


def encode_tokens(tokens: list[int]) -> bytes:
    """A step's tokens, one a row, as the driver sends them and the last stage answers them."""
    return b"".join(t.to_bytes(4, "little") for t in tokens)


def decode_tokens(message: bytes) -> list[int]:
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
    from layerline.stage_worker.layouts import can_pack
    from layerline.stage_worker.tiles import pack, packed_product

    torch.set_num_threads(threads)
    F = torch.nn.functional
    h, i = shapes.hidden_size, shapes.intermediate_size
    kind = getattr(torch, dtype)
    packed = packed and can_pack(kind, "cpu")  # where oneDNN has no kernel for the dtype, torch's plain product

    def weight(seed: int, rows: int, cols: int) -> torch.Tensor:
        w = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * cols**-0.5).to(kind)
        return pack(w) if packed else w  # as layouts.PackedLinear packs: AMX tiles or FMA blocks where they serve

    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return packed_product(x, w, None) if packed else F.linear(x, w)  # packed: as a stage's several rows

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
                x = embedding[decode_tokens(message)]  # [rows, hidden]
            else:
                x = decode(tensor_pb2.Tensor.FromString(message), limits=limits)
            x = compute(x)
            if head is None:
                assert next_address is not None
                if not downstream:  # every stage listens by now: the driver waited for them all
                    channel = grpc.aio.insecure_channel(next_address)
                    downstream.append(
                        channel.stream_stream(
                            f"/{SERVICE}/Step", request_serializer=raw_bytes, response_deserializer=raw_bytes
                        )(
                            wait_for_ready=True  # type: ignore[call-arg]  # grpc-stubs lack grpc.aio's iterator-less call
                        )
                    )
                await downstream[0].write(encode(x).SerializeToString())
            else:
                answers["now"].put_nowait(encode_tokens(linear(x, head).argmax(-1).tolist()))
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
