"""A stage's stream to its next hop, when that hop dies and comes back on the same address."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from layerline.protos.v1 import stage_pb2, stage_pb2_grpc
from layerline.shared.rpc import listen, server_options
from stage_worker.hops import NextHop


class _Echo(stage_pb2_grpc.StageWorkerServicer):
    """A next hop that answers each step's header with an empty, successful result."""

    async def Step(
        self, request_iterator: AsyncIterator[stage_pb2.StepFrame], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[stage_pb2.StepResult]:
        async for frame in request_iterator:
            if frame.HasField("header"):
                yield stage_pb2.StepResult(step_id=frame.header.step_id)


async def _serve(port: int) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=server_options())
    stage_pb2_grpc.add_StageWorkerServicer_to_server(_Echo(), server)
    port = listen(server, f"127.0.0.1:{port}")
    await server.start()
    return server, port


async def _step(hop: NextHop, step_id: int) -> stage_pb2.StepResult:
    answered: asyncio.Future[stage_pb2.StepResult] = asyncio.get_running_loop().create_future()
    await hop.send(stage_pb2.StepHeader(step_id=step_id), [], deliver=answered.set_result)
    return await asyncio.wait_for(answered, 5)


@pytest.mark.timeout(30)
def test_a_next_hop_restarted_on_its_address_takes_the_very_next_step() -> None:
    """The step after a restart reaches the new process at once: the stream's channel went with the
    stream, where a kept channel would still wait out gRPC's reconnect backoff (1 s and more)."""

    async def run() -> tuple[int, int, int, int]:
        server, port = await _serve(0)
        hop = NextHop(f"127.0.0.1:{port}", max_message_bytes=1 << 20)
        try:
            first = await _step(hop, 7)
            await server.stop(None)
            down = await _step(hop, 8)  # the stream is gone: an UNAVAILABLE result naming the hop
            again = await _step(hop, 9)  # and a new stream cannot connect while nothing listens
            server, _ = await _serve(port)
            back = await _step(hop, 10)
            return first.error.code, down.error.code, again.error.code, back.error.code
        finally:
            await hop.close()
            await server.stop(None)

    unavailable = grpc.StatusCode.UNAVAILABLE.value[0]
    assert asyncio.run(run()) == (0, unavailable, unavailable, 0)
